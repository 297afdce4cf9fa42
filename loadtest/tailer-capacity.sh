#!/usr/bin/env bash
# The audit tailer's capacity: how fast `lockcell-cell audit` (release build) turns a
# backlog of etcd history into audit events, with its default SQLite store and local
# archive. Needs etcd and etcdctl on PATH and `cargo build --release -p lockcell-cell`.
#   N=10000 loadtest/tailer-capacity.sh     # N grants, then N releases
# docs/performance.md ("The audit tailer") has the figures.
set -euo pipefail
D=$(mktemp -d)
BIN="$(dirname "$0")/../target/release/lockcell-cell"
EP=127.0.0.1:23790
etcd --name t --data-dir $D/etcd --listen-client-urls http://$EP --advertise-client-urls http://$EP \
  --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
  --initial-cluster t=http://127.0.0.1:23800 --quota-backend-bytes 4294967296 > $D/etcd.log 2>&1 &
ETCD=$!
trap 'kill $ETCD $TAIL 2>/dev/null || true; rm -rf $D' EXIT
TAIL=
for i in $(seq 50); do etcdctl --endpoints $EP endpoint health >/dev/null 2>&1 && break; sleep 0.2; done
$BIN init --etcd $EP
REC='{"session":"9f3c2a1b4d5e6f708192a3b4c5d6e7f8","call":"c1","proxy":"a-1","identity":"host-7/4412","zone":"a","acquired_at_ms":1796000000000}'
# Grants and releases, one revision each (as the lock path makes them): N locks granted,
# then released (holder key deleted with its release marker in one revision).
N=${N:-5000}
# Written through etcdctl, four at a time; the tailer starts once all is written and
# reads it as a backlog, so the write rate does not matter.
seq 1 $N | xargs -P 4 -I{} etcdctl --endpoints $EP put "/l/jobs/n{}/!x" "$REC" >/dev/null
seq 1 $N | xargs -P 4 -I{} sh -c "printf '\ndel /l/jobs/n{}/!x\nput /l/jobs/n{}/!r 1\n\n\n' | etcdctl --endpoints $EP txn >/dev/null"
HEAD=$(etcdctl --endpoints $EP endpoint status -w json | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["Status"]["header"]["revision"])')
echo "backlog: $((2*N)) revisions, head revision $HEAD"
START=$(date +%s.%N)
$BIN audit --etcd $EP --data-dir $D/audit --listen 127.0.0.1:23731 > $D/tailer.log 2>&1 &
TAIL=$!
while :; do
  CP=$(curl -s 127.0.0.1:23731/metrics | awk '/^lockcell_audit_checkpoint_revision /{print $2}')
  [ -n "$CP" ] && [ "${CP%.*}" -ge "$HEAD" ] && break
  sleep 0.1
done
END=$(date +%s.%N)
EVENTS=$(curl -s 127.0.0.1:23731/metrics | awk '/^lockcell_audit_events_total /{print $2}')
python3 -c "s=$END-$START; print(f'caught up {$HEAD} revisions, {int(float(\"$EVENTS\"))} events in {s:.1f} s: {float(\"$EVENTS\")/s:.0f} events/s')"
ps -o rss= -p $TAIL | awk '{print "tailer RSS " $1/1024 " MiB"}'
du -sh $D/audit | awk '{print "store and archive " $1}'
