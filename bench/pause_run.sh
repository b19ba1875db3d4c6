#!/bin/bash
# Stop every process of a running `bench/shifting_load.py` (the benchmark and its load
# generator, Redis, workers, router, tuner, pause watcher) for PAUSE_S seconds, AT_S seconds
# after the live trace started (the tuner's first look in LOG): a VM pause made on purpose, but
# for the kernel, whose TCP timers run on as they do after one (docs/routing.md, run 39).
#
#   python bench/shifting_load.py --only live ... 2> run.log &
#   bench/pause_run.sh run.log 420 35
set -eu
LOG=$1 AT_S=$2 PAUSE_S=$3
until grep -q "tuner at" "$LOG"; do sleep 0.5; done
echo "trace started (first tuner look) $(date +%T)"
sleep "$AT_S"
BENCH=$(pgrep -f "bench/shifting_load.py" | head -1)
desc() { for c in $(ps -e -o pid=,ppid= | awk -v p="$1" '$2==p{print $1}'); do echo "$c"; desc "$c"; done; }
PIDS="$BENCH $(desc "$BENCH" | tr '\n' ' ')"
# shellcheck disable=SC2086
kill -STOP $PIDS
echo "stopped $(date +%T): $(ps -o pid=,comm=,args= -p "$(echo $PIDS | tr ' ' ',')" | cut -c1-120)"
sleep "$PAUSE_S"
# shellcheck disable=SC2086
kill -CONT $PIDS
echo "resumed $(date +%T)"
