"""Writes native/quant/src/avx512_nvfp4_embeddings.inc: one NVFP4 element table per global scale.

Why: the AVX512-VBMI NVFP4 element loop (native/quant/src/avx512_nvfp4_tables.h) needs, for each
input x of a 1x16 block, the byte t[j][m] (m: the 7 mantissa bits of the bf16 x; j: the 3
mantissa bits of the block's E4M3 scale), one of 8 tables of 128 bytes per matrix. Looking up one
of 8 tables per block costs four masked vpermi2b and eight table loads per 64 inputs. If
integers A[m] and B[j] exist with idx = A[m] - B[j] in [0, 127] and one 128-entry table G with
G[idx] = t[j][m] for every (j, m), the loop needs one lookup of A and one of G (both held in
registers) and a per-lane B (a byte per block, like the block's C byte): no table loads.

The tables depend only on the mantissa of 1 / s_g (s_g: the matrix's global scale) while the
quotients stay normal, so one (A, B) serves every exponent of a mantissa. For each of the 128
mantissas a bf16 tensor amax can have, this script builds the ranks 5 * o + class of t exactly
as nvfp4_build_tables does (numpy float32 arithmetic) and asks an integer program (scipy's HiGHS
milp) for a monotone separating embedding: A non-decreasing, the ranks strictly ordered by idx.
Such an embedding is sufficient, not necessary (a non-monotone G may exist where this finds
none). The kernel does not trust this file: it builds G from its own tables and uses it only
when every (j, m) lands on an entry holding its own t[j][m] (nvfp4_embed); otherwise it keeps
the 8 tables. tools/bench/quant_nvfp4_tables_probe.cpp checks both against the fp32 path.

Result on 2026-12-05: 118 of the 128 mantissas have such an embedding; 10 do not (listed in the
generated file) and keep the 8 tables.

Needs scipy (not a project dependency):
  python3 -m venv /tmp/sp && /tmp/sp/bin/pip install scipy numpy
  /tmp/sp/bin/python tools/gen_nvfp4_embeddings.py      (a few seconds)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

f32 = np.float32
OUT = Path(__file__).resolve().parents[1] / "native/quant/src/avx512_nvfp4_embeddings.inc"


def _bits(x: np.float32) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _float(b: int) -> np.float32:
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def ranks(inv: np.float32) -> np.ndarray:
    """[j, m] = 5 * o + class of fl((1 + m/128) * f1_j), as nvfp4_build_tables computes it."""
    r = np.zeros((8, 128), dtype=np.int64)
    for j in range(8):
        f = f32(inv / f32(1 + j / 8))
        f1 = _float((_bits(f) & 0x7FFFFF) | (127 << 23))
        for m in range(128):
            p = _bits(f32(_float((127 << 23) | (m << 16)) * f1))
            o, frac = (p >> 23) - 127, p & 0x7FFFFF
            cls = (
                0 if frac == 0 else 1 if frac <= 0x200000 else 2 if frac < 0x400000
                else 3 if frac < 0x600000 else 4
            )  # fmt: skip
            r[j, m] = 5 * o + cls
    return r


def embed(r: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Integers A[0..127] (non-decreasing), B[0..7] >= 0 separating the ranks of r, or None."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:
        raise SystemExit(
            "gen_nvfp4_embeddings.py needs scipy (not a project dependency): "
            "python3 -m venv /tmp/sp && /tmp/sp/bin/pip install scipy numpy"
        ) from e

    nv = 128 + 8
    rows: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(coefs: list[tuple[int, int]], low: float, high: float) -> None:
        row = np.zeros(nv)
        for k, c in coefs:
            row[k] += c
        rows.append(row)
        lo.append(low)
        hi.append(high)

    for m in range(127):
        add([(m + 1, 1), (m, -1)], 0, np.inf)
    for j in range(8):
        add([(0, 1), (128 + j, -1)], 0, np.inf)
        add([(127, 1), (128 + j, -1)], -np.inf, 127)
    for rho in sorted(set(r.flatten()))[1:]:
        for j in range(8):
            below = [m for m in range(128) if r[j, m] < rho]
            for j2 in range(8):
                above = [m for m in range(128) if r[j2, m] >= rho]
                if below and above:  # A[mb] - B[j] + 1 <= A[ma] - B[j2]
                    mb, ma = max(below), min(above)
                    add([(ma, 1), (128 + j2, -1), (mb, -1), (128 + j, 1)], 1, np.inf)
    # Smallest span of A: small increments (the file stores them as digits).
    cost = np.zeros(nv)
    cost[127], cost[0] = 1, -1
    res = milp(
        c=cost, constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=np.ones(nv), bounds=Bounds(np.full(nv, -300), np.full(nv, 300)),
    )  # fmt: skip
    if res.status != 0:
        return None
    x = np.round(res.x).astype(np.int64)
    a, b = x[:128], x[128:]
    return a - b.min(), b - b.min()


def check(r: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Asserts that one table G indexed by A[m] - B[j] in [0, 127] gives every rank of r."""
    g: dict[int, int] = {}
    for j in range(8):
        for m in range(128):
            idx = int(a[m] - b[j])
            assert 0 <= idx <= 127, (j, m, idx)
            assert g.setdefault(idx, int(r[j, m])) == r[j, m], (j, m, idx)
    assert int(a.max()) <= 255
    assert int(np.diff(a).max()) <= 9


def main() -> None:
    entries: list[tuple[int, np.ndarray, np.ndarray]] = []
    bad: list[int] = []
    for i in range(128):
        amax = _float((127 << 23) | (i << 16))  # a tensor amax of mantissa i (the exponent: any)
        inv = f32(f32(1.0) / f32(amax / f32(2688.0)))  # 1 / nvfp4_global_scale(amax)
        r = ranks(inv)
        sol = embed(r)
        if sol is None:
            bad.append(i)
            continue
        check(r, *sol)
        entries.append((_bits(inv) & 0x7FFFFF, *sol))
    entries.sort(key=lambda e: e[0])
    keys = [k for k, _, _ in entries]
    assert len(set(keys)) == len(keys)
    lines = [
        "// Generated by tools/gen_nvfp4_embeddings.py (which says why and how); do not edit.",
        "// One entry per bf16 tensor-amax mantissa whose NVFP4 element tables collapse into one:",
        "// {mantissa bits of 1 / s_g, B[0..7], A[0], A[m + 1] - A[m] for m = 0..126 as digits}.",
        f"// {len(entries)} of 128; the tensor-amax mantissas (bits 16-22) without one: {bad}.",
        f"static constexpr Nvfp4Embedding kNvfp4Embeddings[{len(entries)}] = {{",
    ]
    for key, a, b in entries:
        d = "".join(str(int(v)) for v in np.diff(a))
        lines.append(f"    {{0x{key:06x}u, {{{', '.join(str(int(v)) for v in b)}}}, {int(a[0])},")
        lines.append(f'     "{d[:64]}"\n     "{d[64:]}"}},')
    lines.append("};")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"{len(entries)} of 128 mantissas embedded; not: {bad}; wrote {OUT}")


if __name__ == "__main__":
    main()
