#!/usr/bin/env bash
# Several tools/gpu_session.sh runs in one call, each with its logs in $OUT/<name>/ (nothing overwritten) and
# its printed summary in /tmp; the per-run install log and environment are dropped (they would crowd out what a
# call returns). Usage:
#   bash tools/gpu_batch.sh NAME 'VAR=value ... bash tools/gpu_session.sh STAGE...' [NAME '...']...
set -u
cd "$(dirname "$0")/.."
root="${OUT:-$PWD/out}"
while [ $# -ge 2 ]; do
  name=$1; spec=$2; shift 2
  mkdir -p "$root/$name"
  env OUT="$root/$name" bash -c "$spec" > "/tmp/gpu_batch_$name.txt" 2>&1
  rm -f "$root/$name/install.log" "$root/$name/environment.txt"
  echo "== $name"; tail -n 4 "/tmp/gpu_batch_$name.txt"
done
