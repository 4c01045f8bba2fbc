#!/usr/bin/env bash
# SpecForge's and ModelOpt's DFlash drafters beside ours on one GPU host (bench/peers/run.py).
#
#   bash bench/quality/device.sh prep            # first: target, completions, cache, eval prompts
#   bash bench/quality/device.sh main "6"        # ours at the same epochs (the table's first row)
#   bash bench/peers/device.sh WORKDIR           # the peers: prep, train, eval, table
#
# RUNS (default: all four) picks runs, e.g. RUNS="specforge-same modelopt-same"; EPOCHS (default 6)
# is the epochs of the same-settings runs; EVAL_BATCH the prompts dflash-eval decodes at once (default:
# the work directory's eval_batch, else 1); SPECFORGE_SHARDING SpecForge's fsdp_sharding (default
# NO_SHARD: DDP, one process, the path the CPU smoke runs; SHARD_GRAD_OP is its FSDP default).
# DEVICE=cpu runs the CPU smoke: both peers' real trainers at the tiny size (SpecForge with sdpa,
# its flex_attention has no CPU backward). SpecForge trains in this process: its CLI sets RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT itself (NCCL on the GPU, gloo on a CPU); its
# offline DFlash path imports none of sglang, yunchang, datasets, wandb, openai-harmony, flash-attn,
# tensorboard (report_to none). The peers' packages and the dependencies the host
# lacks come as wheels from .whl/peers/ (carry ".whl"), installed into a private directory, each
# only when its module does not import already. Fill it on a machine with network:
#   ../shared/tools/device-wheels.sh      # zarr and friends, into .whl/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl/peers specforge==0.2.0 nvidia-modelopt==0.47.0 pydantic==2.13.4 pydantic-core==2.46.4 \
#     annotated-types==0.7.0 typing-inspection==0.4.2 omegaconf==2.3.0 pulp==3.3.2 rich==15.0.0 \
#     markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.20.0 psutil==7.2.2 accelerate==1.15.0 \
#     requests==2.34.2 urllib3==2.7.0 idna==3.20 charset-normalizer==3.4.7 certifi==2026.5.20 \
#     typing-extensions==4.15.0
#   python3 -m pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl/peers   # sdist only
# RESULTS (default $OUT, else WORKDIR/peers) receives peers-results.tgz when the script exits.
set -uo pipefail
cd "$(dirname "$0")/../.."
work=${1:?usage: $0 WORKDIR (a work directory of bench/quality/device.sh prep)}
results=${RESULTS:-${OUT:-$work/peers}}
runs=${RUNS:-specforge-same specforge-own modelopt-same modelopt-own}
mkdir -p "$work/peers" "$results"

site=$(mktemp -d)
if ! python3 -c "import dflash.train.cli" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site/wheels" .whl/*.whl || exit 1
  fi
  mkdir -p "$site/ns/dflash"
  for d in extract train cache_tools runtime prepare eval demo; do ln -sfn "$PWD/$d" "$site/ns/dflash/$d"; done
  export PYTHONPATH="$site/ns:$site/wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
# wheel name prefix -> the module it provides; a module the host imports already is left alone
need=(specforge:specforge nvidia_modelopt:modelopt pydantic-:pydantic pydantic_core:pydantic_core
      annotated_types:annotated_types typing_inspection:typing_inspection omegaconf:omegaconf
      antlr4_python3_runtime:antlr4 pulp:pulp rich:rich markdown_it_py:markdown_it mdurl:mdurl
      pygments:pygments psutil:psutil accelerate:accelerate requests:requests urllib3:urllib3 idna:idna
      charset_normalizer:charset_normalizer certifi:certifi)
picked=()
for pair in "${need[@]}"; do
  prefix=${pair%%:*} module=${pair##*:}
  if [ "$module" != antlr4 ] && python3 -c "import $module" 2>/dev/null; then continue; fi
  wheel=$(ls .whl/peers/${prefix}*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "no module $module here and no .whl/peers/${prefix}*.whl: see the top of $0"; exit 1; }
  picked+=("$wheel")
done
# pydantic 2.13 needs typing_extensions >= 4.14.1, which the host's (torch's) may predate
if ! python3 -c "import sys, importlib.metadata as m; v = m.version('typing_extensions').split('.')
sys.exit(tuple(int(x) for x in v[:3]) < (4, 14, 1))" 2>/dev/null; then
  wheel=$(ls .whl/peers/typing_extensions-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "typing_extensions older than 4.14.1 here and no .whl/peers/typing_extensions-*.whl: see the top of $0"; exit 1; }
  picked+=("$wheel")
fi
# omegaconf 2.3 needs antlr4 4.9 exactly (a newer runtime refuses its grammar): always the carried one
if [ ${#picked[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site/peers" "${picked[@]}" || exit 1
  export PYTHONPATH="$site/peers${PYTHONPATH:+:$PYTHONPATH}"
  echo "peer wheels installed: ${picked[*]##*/}"
fi
# SpecForge's offline DFlash trainer and export as they run (its CLI alone imports only its config)
python3 -c "import specforge.cli, specforge.launch, specforge.training.trainer, specforge.export.to_hf, \
specforge.algorithms.dflash.providers, modelopt.torch.speculative, dflash.eval.cli" || { echo "peers not importable"; exit 1; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

collect() {
  tar czf "$results/peers-results.tgz" -C "$work" --exclude='peers/ckpt' --exclude='peers/target' \
    --exclude='*/output' --exclude='*/hf' --exclude='*.safetensors' peers 2>/dev/null
}
trap collect EXIT
trap 'exit 143' TERM

peers() { python3 bench/peers/run.py --workdir "$work" ${EPOCHS:+--epochs "$EPOCHS"} ${DEVICE:+--device "$DEVICE"} \
  ${EVAL_BATCH:+--eval-batch "$EVAL_BATCH"} ${SPECFORGE_SHARDING:+--specforge-sharding "$SPECFORGE_SHARDING"} "$@"; }
peers prep || exit 1
# a run that failed (a peer out of GPU memory beside others, say) fails the script, after the others ran
rc=0
for r in $runs; do { peers train "$r" && peers eval "$r"; } || rc=1; done
peers table || rc=1
exit $rc
