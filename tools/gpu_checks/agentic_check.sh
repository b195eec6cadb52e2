#!/usr/bin/env bash
# Agentic episodes with SGLang on one GPU: SGLang serves the policy, the TITO session server
# sits in front of it, and terminal tasks run as multi-turn episodes in local sandboxes
# (bubblewrap) with the model acting; then one `miles train` step of the terminal recipe
# against the same server (pre-flight, weight push, scripted episodes, training).
# Each step prints PASS or FAIL. Not run yet: this project's sessions had no GPU.
#
# Why: on the CPU machines the model that acts is SmolLM2-135M in the embedded engine; this is
# the check that the same path runs against real SGLang, and it measures the sandbox share of
# an agentic step there (tools/bench/agentic_step_share.py). About 5-8 minutes.
#
#     bash tools/gpu_checks/agentic_check.sh [--model-path DIR]   # default: a Qwen3-8B-class
#                                                                  # dir in $MODEL_PATH, else a
#                                                                  # tiny random model built here
# Needs: a CUDA torch and SGLang in $PYTHON (default python3), bwrap + util-linux (root), the
# miles packages importable (pip install -e packages/miles-env packages/miles-rollout ...).
# Environment: PYTHON, MODEL_PATH, PORT (default 30000), TIMEOUT_S (default 540).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PORT=${PORT:-30000}
MODEL=${MODEL_PATH:-}
[[ "${1:-}" == "--model-path" ]] && MODEL=$2
OUT=${OUT:-$(mktemp -d)}

"$PY" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
  || { echo "FAIL setup: needs a CUDA torch and a GPU (PYTHON=$PY)"; exit 2; }
"$PY" -c "import sglang; print('sglang', sglang.__version__)" \
  || { echo "FAIL setup: SGLang is not importable (pip install 'miles-rollout[sglang]')"; exit 2; }
command -v bwrap >/dev/null || { echo "FAIL setup: bubblewrap missing (apt-get install bubblewrap)"; exit 2; }
export PYTHONPATH="packages/miles/src:packages/miles-env/src:packages/miles-rollout/src:packages/miles-trainer/src:packages/miles-transfer/src${PYTHONPATH:+:$PYTHONPATH}"

if [[ -z "$MODEL" ]]; then
  MODEL="$OUT/tiny-smol"
  "$PY" - "$MODEL" <<'PYEOF' || { echo "FAIL setup: could not build the tiny model"; exit 2; }
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from miles_rollout.models import smollm2_dir
tok = AutoTokenizer.from_pretrained(smollm2_dir(weights=False))
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
PYEOF
fi
echo "model: $MODEL"

"$PY" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --context-length 4096 --disable-cuda-graph > "$OUT/sglang.log" 2>&1 &
SGL=$!
trap 'kill $SGL 2>/dev/null; wait $SGL 2>/dev/null' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SGL 2>/dev/null || { echo "FAIL sglang: exited"; tail -20 "$OUT/sglang.log"; exit 1; }
  sleep 2
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "FAIL sglang: not healthy after 360 s"; exit 1; }
echo "PASS sglang up"

rc=0
timeout "${TIMEOUT_S:-540}" "$PY" tools/bench/agentic_step_share.py --engine-url "http://127.0.0.1:$PORT" \
  --model-path "$MODEL" --prompts 4 --n 4 --max-turns 6 --max-tokens 512 --json "$OUT/share.json" \
  && "$PY" - "$OUT/share.json" <<'PYEOF' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
for name in ("scripted", "model"):
    s = r[name]
    ok = not s["failed"] and s["episodes"] == 16 and s["turns"] >= 16 and s["sandbox_s"] > 0
    ok = ok and (name == "scripted" or s["response_tokens"] > 0)
    print(("PASS" if ok else "FAIL"), f"episodes {name}: share of sandboxes {s['sandbox_share']:.2f}, "
          f"generation {s['generate_s']:.1f} s, sandboxes {s['sandbox_s']:.1f} s, wall {s['wall_s']:.1f} s, "
          f"reward {s['reward_mean']:.2f}, failed {s['failed'][:2]}")
    if not ok:
        sys.exit(1)
PYEOF
[[ $rc == 0 ]] || echo "FAIL episodes"

cat > "$OUT/terminal_gpu.py" <<PYEOF
from miles.recipes.terminal import recipe as base


def recipe():
    r = base(model_path="$MODEL")
    r["rollout"].update(engine_url="http://127.0.0.1:$PORT", mode="sync", prompts_per_step=2)
    r["trainer"].update(dtype="bfloat16", micro_batch_size=2)
    return r
PYEOF
if timeout "${TIMEOUT_S:-540}" "$PY" -m miles train "$OUT/terminal_gpu.py" --steps 1 --out "$OUT/run" --no-progress > "$OUT/train.log" 2>&1 \
   && grep -q '"rollout/agentic/turns"' "$OUT/run/metrics.jsonl"; then
  echo "PASS miles train terminal (1 step against SGLang): $(tail -1 "$OUT/run/metrics.jsonl" | head -c 300)"
else
  echo "FAIL miles train terminal"; tail -20 "$OUT/train.log"; rc=1
fi
exit $rc
