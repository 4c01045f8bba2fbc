#!/usr/bin/env bash
# The quality benchmark on one GPU host in as few GPU minutes as possible.
#
#   bash bench/quality/device.sh prep                 # generate + extract (the target stage if
#                                                     # WORKDIR/target is not there: ~2.5 min more)
#   bash bench/quality/device.sh main "2"             # one variant alone: train, then decode at 16 and 8
#   bash bench/quality/device.sh side "1" "1 --lr-schedule cosine" ...
#                                                     # variants trained and decoded side by side
#                                                     # (their taus are exact; their times are shared,
#                                                     # and the table marks them so)
#   bash bench/quality/device.sh table
#
# DOMAIN=prose runs the prose domain (default code), VOCAB=bytes the byte-level target (default
# bpe); each pair has its own WORKDIR (default /dev/shm/dflash-quality-DOMAIN[-bytes]).
# SMALL=1 runs the CPU size (a check of the script). EVAL_BLOCKS=16 decodes at block 16 only
# (default: main the sizes' eval_block_sizes, side 16,8). STAGES=train: main and side train without decoding (STAGES=eval then decodes what they trained). WORKDIR keeps every stage; a rerun skips what is recorded.
# RESULTS (default $OUT, else WORKDIR/results) receives results.tgz (stage records, eval
# reports, logs, metrics.jsonl) whenever the script exits, also on a timeout's SIGTERM, so give
# the whole command a deadline a little under the host's (`timeout 570 bash ...`).
# Without the package installed, it runs from this checkout (PYTHONPATH); zarr and the other
# wheels may come from a `.whl/` folder beside it (installed into a private directory).
set -uo pipefail
cd "$(dirname "$0")/../.."
domain=${DOMAIN:-code}
vocab=${VOCAB:-bpe}
work=${WORKDIR:-/dev/shm/dflash-quality-$domain$([ "$vocab" = bpe ] || echo "-$vocab")}
results=${RESULTS:-${OUT:-$work/results}}
sets=(--set extract_args=--store-topk,8 ${QUALITY_SETS:-})  # QUALITY_SETS: more, e.g. "--set vocab_size=32768" (its own WORKDIR)
mkdir -p "$work" "$results"

if ! python3 -c "import dflash.train.cli" 2>/dev/null; then
  site=$(mktemp -d)
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site/wheels" .whl/*.whl || exit 1
  fi
  mkdir -p "$site/ns/dflash"
  for d in extract train cache_tools runtime prepare eval demo; do ln -sfn "$PWD/$d" "$site/ns/dflash/$d"; done
  export PYTHONPATH="$site/ns:$site/wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import dflash.train.cli, dflash.extract.cli, zarr" || { echo "dflash or zarr not importable"; exit 1; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

collect() {
  local keep=$(mktemp -d)/results
  mkdir -p "$keep"
  cp "$work"/stages/*.json "$work"/eval-*.json "$work"/*.log "$work"/table.md "$keep"/ 2>/dev/null
  for r in "$work"/run-*; do [ -f "$r/metrics.jsonl" ] && cp "$r/metrics.jsonl" "$keep/$(basename "$r").metrics.jsonl"; done
  tar czf "$results/results.tgz" -C "$(dirname "$keep")" results
}
trap collect EXIT
trap 'exit 143' TERM

bench() { python3 bench/quality/run.py --workdir "$work" --domain "$domain" --vocab "$vocab" ${SMALL:+--small --device cpu} "${sets[@]}" "$@"; }
what=${1:-}; shift || true
rc=0  # the first failure's status: the table still prints, and the script exits with it
case "$what" in
  prep) bench --stages target,generate,extract --variant 1 || rc=$? ;;
  main) for v in "$@"; do
          bench --stages "${STAGES:-train,eval}" ${EVAL_BLOCKS:+--eval-blocks "$EVAL_BLOCKS"} --variant "$v" || { s=$?; [ $rc -ne 0 ] || rc=$s; }
        done ;;
  side)
    export DFLASH_QUALITY_SIDE_BY_SIDE=$#  # the table marks their seconds as shared
    pids=()
    for v in "$@"; do
      bench --stages "${STAGES:-train,eval}" --eval-blocks "${EVAL_BLOCKS:-16,8}" --variant "$v" > "$work/side-$(echo "$v" | tr -c 'a-zA-Z0-9' '_').log" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || { s=$?; [ $rc -ne 0 ] || rc=$s; }; done ;;
  table) ;;
  *) echo "usage: $0 prep | main VARIANT... | side VARIANT... | table"; exit 2 ;;
esac
bench --stages table --variant 1 | tail -20
[ $rc -eq 0 ] || echo "bench/quality/device.sh: a run failed (status $rc); its error is above" >&2
exit $rc
