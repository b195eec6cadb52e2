"""Can NVFP4's per-block element tables collapse into one lookup? A feasibility check.

Why: the AVX512-VBMI NVFP4 element loop (native/quant/src/avx512_nvfp4_tables.h) looks up one
of 8 tables per 16-element block (the block scale's 3 mantissa bits j pick it), four masked
vpermi2b and eight table loads per 64 inputs; that is why it costs 0.093 ns/el in L1 against
0.05 for MXFP4 (docs/benchmarks.md). If, for a matrix's global scale, integers A[m] (m: the 7
mantissa bits of a bf16 x) and B[j] exist with idx = A[m] - B[j] in [0, 127] such that one
128-entry table G gives G[idx] = t[j][m] (t: the current tables' o + 11 * class), the loop needs
one lookup of A (registers), one per-lane B (like the block's C byte) and one of G: no table
loads. This script builds t exactly as nvfp4_build_tables does (numpy float32 arithmetic) for
every bf16 global-amax mantissa and asks an integer program (scipy's HiGHS milp) for a monotone
separating embedding: (o, class) ranks strictly ordered by idx. A solution is sufficient, not
necessary (a non-monotone G may exist where this finds none); a kernel would still verify G
against t at table-build time and keep the per-block tables where it fails.

Result on 2026-12-05: 118 of the 128 global-scale mantissas have such an embedding; 10 do not
(mantissas listed by the script).

Needs scipy (not a project dependency): python3 -m venv /tmp/sp && /tmp/sp/bin/pip install scipy
numpy && /tmp/sp/bin/python tools/bench/nvfp4_embedding_feasibility.py   (about 1 minute)
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def _bits(x: np.float32) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _float(b: int) -> np.float32:
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def ranks(s_g: np.float32) -> np.ndarray:
    """[j, m] = 5 * o + class of fl((1 + m/128) * f1_j), as nvfp4_build_tables computes it."""
    inv = f32(1.0) / s_g
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


def embeddable(r: np.ndarray) -> bool:
    """Whether integers A[0..127] (non-decreasing), B[0..7] separate the ranks of r."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:
        raise SystemExit(
            "nvfp4_embedding_feasibility.py needs scipy (not a project dependency): "
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
    res = milp(
        c=np.zeros(nv), constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=np.ones(nv), bounds=Bounds(np.full(nv, -300), np.full(nv, 300)),
    )  # fmt: skip
    return bool(res.status == 0)


def main() -> None:
    bad = []
    for i in range(128):
        amax = _float((127 << 23) | (i << 16))
        if not embeddable(ranks(f32(amax / f32(2688.0)))):
            bad.append(i)
    print(f"embeddable: {128 - len(bad)} of 128 global-scale mantissas; not: {bad}")


if __name__ == "__main__":
    main()
