#!/bin/sh
# compose.yaml's router: vllm-router in front of ENGINE_REPLICAS prefixserve replicas.
#
# ENGINE_URL, ENGINE_KV_EVENTS and ENGINE_KV_REPLAY are printf formats of a replica's index 1..N
# (compose names replica i `prefixserve-engine-i`). With ROUTER_POLICY=kv_aware each replica's ZMQ
# KV event stream is attached with --kv-event-source (and its replay socket): vllm-router 0.1.17 does
# not attach them from the replicas' /kv_event_sources on its own. Extra arguments go to vllm-router.
set -eu
: "${ROUTER_POLICY:=cache_aware}" "${ENGINE_REPLICAS:=3}" "${ROUTER_HOST:=0.0.0.0}" "${ROUTER_PORT:=8000}"
: "${ROUTER_METRICS_PORT:=29000}" "${MODEL_NAME:=prefixserve}" "${BLOCK_SIZE:=16}"
: "${ENGINE_URL:=http://prefixserve-engine-%s:8000}"
: "${ENGINE_KV_EVENTS:=tcp://prefixserve-engine-%s:5557}" "${ENGINE_KV_REPLAY:=tcp://prefixserve-engine-%s:5558}"

urls=""
kv=""
i=1
while [ "$i" -le "$ENGINE_REPLICAS" ]; do
    url=$(printf "$ENGINE_URL" "$i")
    urls="$urls $url"
    if [ "$ROUTER_POLICY" = kv_aware ]; then
        kv="$kv --kv-event-source $url=$(printf "$ENGINE_KV_EVENTS" "$i")"
        kv="$kv --kv-event-replay-source $url=$(printf "$ENGINE_KV_REPLAY" "$i")"
    fi
    i=$((i + 1))
done
if [ "$ROUTER_POLICY" = kv_aware ]; then
    kv="$kv --kv-event-model $MODEL_NAME --kv-event-block-size $BLOCK_SIZE"
fi

# Health: a replica failing 2 checks 5 s apart gets no new requests; requests that fail to reach a
# replica are retried on another (vllm-router's defaults: retries with backoff, circuit breaker).
# shellcheck disable=SC2086  # $urls and $kv are word lists on purpose
exec vllm-router --host "$ROUTER_HOST" --port "$ROUTER_PORT" \
    --prometheus-host "$ROUTER_HOST" --prometheus-port "$ROUTER_METRICS_PORT" \
    --policy "$ROUTER_POLICY" --worker-urls $urls $kv \
    --worker-startup-timeout-secs 900 --worker-startup-check-interval 2 \
    --health-check-interval-secs 5 --health-failure-threshold 2 --health-success-threshold 1 \
    "$@"
