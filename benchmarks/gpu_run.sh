#!/usr/bin/env bash
# Everything the GPU issue asks for, as one call on a lent GPU machine (see the device tool's
# README: one short prepared script, a few minutes of device time in all).
#
#   bash benchmarks/gpu_run.sh prepare     # here, with the package registry: fills .gpu/ (ignored)
#   bash benchmarks/gpu_run.sh run DIR [STEP ...]   # there: the steps (default all), each under its own
#                                                   # time limit, logs in DIR
#
# prepare writes .gpu/llama-3.1-8b/ (Llama 3.1 8B's config.json, written from the engine's
# geometry, beside the bundled model's tokenizer: --random-weights needs no weights, and the
# GPU machine has neither network nor the bundled model) and .gpu/whl/ (the pure-Python
# packages kvchat needs that the GPU machine's image lacks: textual and its parts, gguf,
# platformdirs). run installs those wheels into /tmp/site and runs, in order of value:
#   1. nvidia-smi and the versions;
#   2. benchmarks/gpu_check.py --quick (kernels against their references, copy bandwidth, the
#      decode kernel's bandwidth, prefill, end to end beside transformers, batched decode);
#   3. the app itself, driven by Textual's Pilot on the real engine (benchmarks/gpu_app.py);
#   4. kvchat bench on the 8B geometry at 1k, 8k and 32k (TTFT of a reused prefix, peers);
#   5. kvchat bench --batch 1,8,32,64 at 1k and 4k;
#   6. the same bench with the CUDA graph set aside (KVCHAT_CUDA_GRAPH=0);
#   7. kvchat ask --json;
#   8. a new turn's TTFT after 1k and 8k of history, profiled on the host (gpu_ttft.py);
#   9. a decode step's kernels at 1k, from torch's profiler (gpu_profile.py).
# Steps by name: env check app bench batch eager ask ttft profile (and correct: gpu_check's
# correctness section alone).
# DIR gets summary.txt (every step's output), the JSON and PNG files, and the app's screen.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
model=${GPU_RUN_MODEL:-.gpu/llama-3.1-8b}   # GPU_RUN_MODEL: another directory, to try the script on a CPU

prepare() {
    set -e
    mkdir -p "$model" .gpu/whl
    python3 - "$model" <<'EOF'
import json, shutil, sys
from pathlib import Path
from kvchat.engine.geometry import KNOWN
from kvchat.engine.sources import bundled_dir
out, g = Path(sys.argv[1]), KNOWN["llama-3.1-8b"]
cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=g.vocab_size, hidden_size=g.hidden,
           intermediate_size=g.intermediate, num_hidden_layers=g.n_layers, num_attention_heads=g.n_heads,
           num_key_value_heads=g.n_kv_heads, head_dim=g.head_dim, max_position_embeddings=g.max_position,
           rms_norm_eps=g.norm_eps, rope_theta=g.rope_theta, rope_scaling=dict(g.rope_scaling),
           tie_word_embeddings=g.tie_embeddings, bos_token_id=g.bos_token_id, eos_token_id=list(g.eos_token_ids),
           torch_dtype="bfloat16")
(out / "config.json").write_text(json.dumps(cfg, indent=1))
src = bundled_dir()
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
print(f"{out}: config.json of {g.name}, the bundled tokenizer")
EOF
    local have
    have=$(python3 -m pip list --format=freeze 2>/dev/null)
    local pkgs=()
    for p in textual textual-plotext plotext gguf platformdirs rich markdown-it-py mdit-py-plugins linkify-it-py \
             uc-micro-py; do
        pkgs+=("$(grep -i "^${p}==" <<<"$have" || echo "$p")")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl "${pkgs[@]}"
    ls .gpu/whl
    du -sh .gpu
}

run() {
    local out=${1:?run needs the output folder}
    shift
    mkdir -p "$out"
    local sum="$out/summary.txt"
    export PYTHONUNBUFFERED=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" | tee -a "$sum"
    export PYTHONPATH=/tmp/site:$here
    step() {   # step NAME LIMIT_S COMMAND...: its output into the summary, its time and exit status after
        local name=$1 limit=$2
        shift 2
        echo "==== $name (limit ${limit} s): $*" | tee -a "$sum"
        local t0=$SECONDS
        timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$sum" >/dev/null
        local rc=${PIPESTATUS[0]}
        echo "==== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$sum"
    }
    local steps=${*:-env check app bench batch eager ask ttft profile}
    for name in $steps; do
        case $name in
        env) step env 20 bash -c 'nvidia-smi; nproc; free -g | head -2; command -v tmux || echo "no tmux";
            python3 -c "import sys, torch, triton, transformers, textual; print(sys.version.split()[0], torch.__version__,
            triton.__version__, transformers.__version__, textual.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA\")"' ;;
        correct) step gpu_check 90 python3 benchmarks/gpu_check.py --only env,correctness ;;
        check) step gpu_check 250 python3 benchmarks/gpu_check.py --quick --sweep --json "$out/gpu_check.json" ;;
        app) step app 60 python3 benchmarks/gpu_app.py --out "$out" -- --model "$model" --random-weights --max-tokens 32 ;;
        bench) step bench 80 python3 -m kvchat bench --model "$model" --random-weights --contexts 1024,8192,32768 \
            --runs 2 --kv-budget 24GiB --new-tokens 16 --no-llama-cpp --json "$out/bench.json" --plot "$out/bench.png" ;;
        batch) step batch 90 python3 -m kvchat bench --model "$model" --random-weights --batch 1,8,32,64 \
            --contexts 1024,4096 --runs 1 --new-tokens 16 --no-peers --json "$out/batch.json" --plot "$out/batch.png" ;;
        eager) step eager 45 env KVCHAT_CUDA_GRAPH=0 python3 -m kvchat bench --model "$model" --random-weights \
            --contexts 1024,8192 --runs 1 --new-tokens 16 --no-peers ;;
        ask) step ask 30 python3 -m kvchat ask --model "$model" --random-weights --json --max-tokens 32 \
            "What does a KV cache hold?" ;;
        ttft) step ttft 60 python3 benchmarks/gpu_ttft.py --model "$model" --random-weights --contexts 1024,8192 ;;
        profile) step profile 45 python3 benchmarks/gpu_profile.py --model "$model" --random-weights --context 1024 ;;
        *) echo "unknown step $name" | tee -a "$sum" ;;
        esac
    done
    echo "==== verdicts" | tee -a "$sum"
    grep -E "^(PASS|FAIL)|passed, .* failed|FAIL|ERROR|Traceback" "$sum" | grep -v "^==== " | tail -60
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash benchmarks/gpu_run.sh prepare | run DIR" >&2; exit 2 ;;
esac
