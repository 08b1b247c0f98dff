#!/usr/bin/env bash
# Diagnose rank0-killed on one GPU: where rank 1 spends its time.
export LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 NCCL_SOCKET_IFNAME=lo DUPLEX_STORE_TOKEN=diag-token-0123456789abcdef
which gdb eu-stack > $OUT/tools.txt 2>&1
port=29600
for lanes in eager lazy; do
  port=$((port + 10)); export MASTER_PORT=$port DUPLEX_PORT=$((port + 1))
  if [ $lanes = lazy ]; then export DUPLEX_LANES=lazy; fi
  RANK=0 NCCL_HOSTID=h0-$port .gpu/faults rank rank0-killed > $OUT/r0-$lanes.txt 2>&1 & p0=$!
  RANK=1 NCCL_HOSTID=h1-$port .gpu/faults rank rank0-killed > $OUT/r1-$lanes.txt 2>&1 & p1=$!
  t0=$(date +%s.%N)
  for i in $(seq 1 300); do grep -q MARK $OUT/r0-$lanes.txt && break; sleep 0.1; done
  tk=$(date +%s.%N); kill -9 $p0
  for s in 5 10; do
    sleep 5
    if kill -0 $p1 2>/dev/null; then
      timeout 20 gdb -p $p1 -batch -ex "thread apply all bt" > $OUT/bt$s-$lanes.txt 2>&1 || timeout 20 eu-stack -p $p1 > $OUT/bt$s-$lanes.txt 2>&1
    fi
  done
  timeout 50 tail --pid=$p1 -f /dev/null; te=$(date +%s.%N)
  echo "$lanes: MARK at $(python3 -c "print(round($tk-$t0,1))") s; rank 1 ended $(python3 -c "print(round($te-$tk,1))") s after the kill"
  tail -c 600 $OUT/r1-$lanes.txt; echo
  kill -9 $p1 2>/dev/null
done
