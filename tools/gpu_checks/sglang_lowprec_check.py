"""SGLang serving Miles' low-precision formats with the flags the fleet sets (GPU check).

Why: on the CPU machines the SGLang flags of each ``weight_format`` are only tested by argument
building (``miles_rollout.fleet.sglang.quantization_args``). This starts
``python -m sglang.launch_server`` with those flags for each format on a tiny random Qwen3
(bf16, built on the spot; nothing is downloaded): fp8_block128 and mxfp8 from the BF16
checkpoint (SGLang quantizes online), nvfp4 and int4_g128 from a checkpoint miles-quant exports
(ModelOpt NVFP4, compressed-tensors W4A16). Per format: the server starts, ``/generate``
returns tokens with finite logprobs, and the logprobs are compared with the embedded engine
serving the same ``weight_format`` (printed: max and mean gap; informational, SGLang also
quantizes activations for fp8/mxfp8/nvfp4). mxfp4 is MoE-only in SGLang: not run on this
dense model. Each step prints PASS / FAIL.

    bash tools/gpu_checks/sglang_lowprec_check.sh            # GPU + SGLang
    bash tools/gpu_checks/sglang_lowprec_check.sh --dry-run-cpu   # models, exports, argv only
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FORMATS = {"fp8_block128": False, "mxfp8": False, "nvfp4": True, "int4_g128": True}  # export?
PROMPTS = [[11, 12, 13, 14, 15, 16], [100, 7, 99, 3]]
failed = 0


def report(ok: bool, step: str, detail: str = "") -> None:
    global failed
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'} {step}{': ' + detail if detail else ''}", flush=True)


def build_model(path: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.1,
        dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(cfg)
    model.to(dtype=torch.bfloat16).save_pretrained(path)  # type: ignore[call-arg]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(2)
    return False


def embedded_logprobs(model: Path, fmt: str, outputs: list[list[int]]) -> list[list[float]]:
    import torch

    from miles_rollout import EngineConfig

    with EngineConfig(model_path=str(model), dtype="bfloat16", weight_format=fmt).build() as e:
        hf = e.model
        served = e.quantized_weights
        assert served is not None
        out = []
        for prompt, ids in zip(PROMPTS, outputs):
            # Teacher-forced through the engine's own weights: dequantized copies swapped in.
            with torch.inference_mode():
                saved = {}
                for name, p in hf.named_parameters():
                    if name in served.names:
                        saved[name] = p.detach().clone()
                        p.copy_(served.dequantized(name))
                logits = hf(torch.tensor([prompt + ids])).logits[0].float()
                for name, p in hf.named_parameters():
                    if name in saved:
                        p.copy_(saved[name])
            logp = torch.log_softmax(logits, -1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1)
            out.append(logp[pos, torch.tensor(ids)].tolist())
        return out


def main() -> int:
    dry = "--dry-run-cpu" in sys.argv
    from miles_quant.checkpoint import export_checkpoint
    from miles_rollout.fleet.engines import free_port
    from miles_rollout.fleet.sglang import sglang_argv

    tmp = Path(tempfile.mkdtemp(prefix="miles-lowprec-"))
    base = tmp / "bf16"
    build_model(base)
    report(True, "tiny bf16 Qwen3 built", str(base))
    for fmt, export in FORMATS.items():
        model = base
        if export:
            model = tmp / fmt
            try:
                export_checkpoint(base, model, fmt)
            except Exception as e:
                report(False, f"{fmt} export", repr(e))
                continue
            report(True, f"{fmt} export", str(model))
        port = free_port()
        argv = sglang_argv(
            index=0,
            model_path=str(model),
            host="127.0.0.1",
            port=port,
            dp_size=1,
            sglang_args={
                "skip_tokenizer_init": True,
                "disable_cuda_graph": True,
                "mem_fraction_static": 0.3,
            },
            weight_format=fmt,
        )
        print("  " + " ".join(argv), flush=True)
        if dry:
            report("--quantization" in argv, f"{fmt} argv (dry run: SGLang not started)")
            ref = embedded_logprobs(base, fmt, [[1, 2, 3], [4, 5]])
            ok = all(math.isfinite(x) for lp in ref for x in lp)
            report(ok, f"{fmt} embedded reference logprobs (what SGLang is compared with)")
            continue
        log = (tmp / f"{fmt}.log").open("w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            if not wait_healthy(url, proc):
                tail = (tmp / f"{fmt}.log").read_text()[-1500:]
                report(False, f"{fmt} server start", tail)
                continue
            outs, lps = [], []
            for prompt in PROMPTS:
                r = post(
                    url + "/generate",
                    {
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                        "return_logprob": True,
                    },
                )
                outs.append(list(r["output_ids"]))
                lps.append([t[0] for t in r["meta_info"]["output_token_logprobs"]])
            finite = all(math.isfinite(x) for lp in lps for x in lp)
            report(finite and all(outs), f"{fmt} generate", f"{sum(map(len, outs))} tokens")
            ref = embedded_logprobs(base, fmt, outs)
            gaps = [abs(a - b) for la, lb in zip(lps, ref) for a, b in zip(la, lb)]
            print(
                f"  {fmt}: |SGLang - embedded| max {max(gaps):.4f} mean {sum(gaps) / len(gaps):.4f}"
            )
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"{'FAIL' if failed else 'PASS'}: {failed} step(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        for d in Path(tempfile.gettempdir()).glob("miles-lowprec-*"):
            shutil.rmtree(d, ignore_errors=True)
