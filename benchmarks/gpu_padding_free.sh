# Issue 57 item 6 on a lent GPU (the device tool; CI never runs this): padded against --padding_free, bf16 autocast,
# PyTorch SDPA, SmolLM2-135M's architecture with random weights (the shipped weights, 540 MB, cannot be sent),
# GPU-sized micro-batches. The GPU machine has torch, transformers and accelerate but no network; prepare here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#   M=$(python benchmarks/smollm2.py | tail -1); mkdir -p .gpu/smollm2; cp $M/*.json $M/*.jinja .gpu/smollm2/
# then run, carrying .whl, .gpu and tiny_tldr:  bash benchmarks/gpu_padding_free.sh [scripts, default: sft dpo grpo]
# (RUNS, STEPS, STEP_LIMIT: runs per variant, logged steps, seconds per script; a short check: RUNS=1 STEPS=4)
# One script takes about 2.5 min (grpo about 3, hence STEP_LIMIT 200): on 2026-12-04 grpo ran in a second call (--steps 5).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/env.txt
python3 - <<'PY' 2>&1 | tee -a $OUT/env.txt
import importlib.util as u, torch, transformers, accelerate, datasets, tyro
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "accelerate",
      accelerate.__version__, "datasets", datasets.__version__, "tyro", tyro.__version__)
print("flash_attn:", u.find_spec("flash_attn") is not None, "kernels:", u.find_spec("kernels") is not None)
PY
python3 benchmarks/random_init.py .gpu/smollm2 /tmp/smol 2>&1 | tail -1 | tee -a $OUT/env.txt
declare -A BATCH=([sft]="--per_device_train_batch_size 32" [dpo]="--per_device_train_batch_size 16"
                  [grpo]="--per_device_train_batch_size 64 --num_generations 4")
for s in ${@:-sft dpo grpo}; do
  mkdir -p $OUT/$s
  timeout ${STEP_LIMIT:-200} python3 benchmarks/padding_free.py --model smollm2 --model_path /tmp/smol --scripts $s \
    --runs ${RUNS:-2} --steps ${STEPS:-6} --threads 8 --timeout 100 --extra="--bf16 ${BATCH[$s]}" --results_dir $OUT/$s \
    --note "lent H200, bf16 autocast, SDPA, SmolLM2-135M architecture with random weights, GPU-sized batches" \
    2>&1 | tee $OUT/$s/log.txt
  rm -f $OUT/$s/padding_free.md
done
