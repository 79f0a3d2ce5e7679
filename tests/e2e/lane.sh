#!/usr/bin/env bash
# One e2e lane: real engines (unmodified vLLM or SGLang, CPU) behind `pd-gateway serve`, then the
# tests in tests/e2e/ (pytest -m e2e). Run by `make e2e-vllm` / `make e2e-sglang`, which first build
# the engine's venv; tests/e2e/README.md ("Where the lane's settings come from") says where every
# flag and variable comes from.
#
#   tests/e2e/lane.sh vllm|sglang [pytest args...]
#
# Starts a single reference server and a prefill + decode pair, each in its own session (setsid),
# so that the EXIT trap can stop every process it started by process group, on success, on failure
# and on Ctrl-C. The engines start on all cores and are pinned to E2E_ENGINE_CPUS (default: the
# last core) once they are up, so the other core stays free for the gateway and the tests (NIXL's
# UCX progress thread spins one core per vLLM P/D server even when idle).
#
# Environment (all optional): E2E_PORT_BASE (default 18400 vLLM, 31600 SGLang), E2E_ENGINE_CPUS,
# E2E_READY_TIMEOUT_S (240), E2E_WARM_TIMEOUT_S (600), E2E_PYTEST_TIMEOUT_S (900), E2E_RUN_DIR (logs; default .cache/e2e/run-ENGINE), E2E_HOLD=1 (keep
# everything running instead of testing, for debugging; stop the script with SIGTERM).
set -euo pipefail

ENGINE=${1:?usage: tests/e2e/lane.sh vllm|sglang [pytest args...]}
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"

case "$ENGINE" in
vllm) VENV=.venv-vllm; BASE=${E2E_PORT_BASE:-18400} ;;
sglang) VENV=.venv-sglang; BASE=${E2E_PORT_BASE:-31600} ;;
*) echo "unknown engine: $ENGINE" >&2; exit 2 ;;
esac
PY="$ROOT/$VENV/bin/python"
GW_BIN="$ROOT/.venv/bin/pd-gateway"
MODEL="$ROOT/.cache/e2e/tiny-llama-$ENGINE"
RUN_DIR=${E2E_RUN_DIR:-$ROOT/.cache/e2e/run-$ENGINE}
READY_TIMEOUT_S=${E2E_READY_TIMEOUT_S:-240}
NCPU=$(nproc)
ENGINE_CPUS=${E2E_ENGINE_CPUS:-$((NCPU - 1))}

SINGLE_PORT=$BASE
PREFILL_PORT=$((BASE + 1))
DECODE_PORT=$((BASE + 2))
GATEWAY_PORT=$((BASE + 3))
SIDE_P=$((BASE + 11)) # vLLM NIXL side channels
SIDE_D=$((BASE + 12))
BOOTSTRAP_PORT=$((BASE + 10)) # SGLang prefill bootstrap server

T0=$(date +%s)
say() { printf '[e2e-%s %4ss] %s\n' "$ENGINE" "$(($(date +%s) - T0))" "$*" >&2; }

rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"

# -- process groups, stopped by the trap ---------------------------------------------------------
declare -A PGID=()

stop_all() {
	local name pg deadline
	for name in "${!PGID[@]}"; do
		kill -TERM -- "-${PGID[$name]}" 2>/dev/null || true
		kill -CONT -- "-${PGID[$name]}" 2>/dev/null || true # a test may have SIGSTOPped it
	done
	deadline=$(($(date +%s) + 20))
	for name in "${!PGID[@]}"; do
		pg=${PGID[$name]}
		while pgrep -g "$pg" >/dev/null 2>&1 && (($(date +%s) < deadline)); do sleep 0.2; done
		if pgrep -g "$pg" >/dev/null 2>&1; then
			say "$name (pgid $pg) ignored SIGTERM: SIGKILL"
			kill -KILL -- "-$pg" 2>/dev/null || true
		fi
	done
	PGID=()
}

on_exit() {
	local rc=$?
	trap - EXIT INT TERM
	if ((${#PGID[@]})); then
		say "stopping ${!PGID[*]}"
		stop_all
	fi
	if ((rc != 0)); then
		local f
		for f in "$RUN_DIR"/*.log; do
			[[ -f $f ]] || continue
			echo "----- last lines of $f -----" >&2
			tail -n 40 "$f" >&2 || true
		done
	fi
	say "exit $rc (logs in $RUN_DIR)"
	exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start NAME CMD...: run CMD in a new session (pgid = its pid), output to RUN_DIR/NAME.log
start() {
	local name=$1
	shift
	setsid "$@" >"$RUN_DIR/$name.log" 2>&1 </dev/null &
	PGID[$name]=$!
	echo "${PGID[$name]}" >"$RUN_DIR/$name.pgid"
}

# wait_http NAME URL: until URL answers 200, failing fast if NAME's process group is gone
wait_http() {
	local name=$1 url=$2 deadline=$(($(date +%s) + READY_TIMEOUT_S))
	until curl -fsS -o /dev/null --max-time 5 "$url" 2>/dev/null; do
		if ! pgrep -g "${PGID[$name]}" >/dev/null 2>&1; then
			say "$name died while starting"
			return 1
		fi
		if (($(date +%s) > deadline)); then
			say "$name not ready after ${READY_TIMEOUT_S}s ($url)"
			return 1
		fi
		sleep 1
	done
	say "$name ready ($url)"
}

pin() { # pin every thread of every process in NAME's group to ENGINE_CPUS
	local name=$1 pid
	for pid in $(pgrep -g "${PGID[$name]}"); do
		taskset -a -c -p "$ENGINE_CPUS" "$pid" >/dev/null 2>&1 || true
	done
}

for port in $SINGLE_PORT $PREFILL_PORT $DECODE_PORT $GATEWAY_PORT $SIDE_P $SIDE_D $BOOTSTRAP_PORT; do
	if ss -Hltn "sport = :$port" | grep -q .; then
		say "port $port is already in use (set E2E_PORT_BASE)"
		exit 1
	fi
done

TOOL_ENV=()
if [[ $ENGINE == sglang ]]; then
	# PyPI's torchvision (imported by transformers too) needs the CUDA stubs to load
	STUB="$ROOT/$VENV/cudastub"
	[[ -f $STUB/libc10_cuda.so ]] || "$PY" tests/e2e/shims/build_cudastubs.py --out "$STUB"
	TOOL_ENV=("LD_LIBRARY_PATH=$STUB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
fi
say "model"
env "${TOOL_ENV[@]}" "$PY" tools/build_tiny_model.py --out "$MODEL"

# -- engines -------------------------------------------------------------------------------------
if [[ $ENGINE == vllm ]]; then
	COMMON_ENV=(
		VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1
		VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
		VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
	)
	# Identical flags on all three servers: compiled and eager modes give different greedy tokens.
	COMMON=(
		-m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny
		--host 127.0.0.1 --max-model-len 512 --max-num-seqs 8 --dtype bfloat16 --seed 0
		--enforce-eager
	)
	KV='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
	say "starting vLLM single :$SINGLE_PORT, prefill :$PREFILL_PORT, decode :$DECODE_PORT"
	start single env "${COMMON_ENV[@]}" "$PY" "${COMMON[@]}" --port "$SINGLE_PORT"
	start prefill env "${COMMON_ENV[@]}" VLLM_NIXL_SIDE_CHANNEL_PORT="$SIDE_P" \
		"$PY" "${COMMON[@]}" --port "$PREFILL_PORT" --kv-transfer-config "$KV"
	start decode env "${COMMON_ENV[@]}" VLLM_NIXL_SIDE_CHANNEL_PORT="$SIDE_D" \
		"$PY" "${COMMON[@]}" --port "$DECODE_PORT" --kv-transfer-config "$KV"
	HEALTH=/health
	GW_ARGS=(--engine vllm --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT")
else
	COMMON_ENV=(
		SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 OMP_NUM_THREADS=1
		MC_FORCE_TCP=1 SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1
		"LD_LIBRARY_PATH=$STUB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
		"PYTHONPATH=$ROOT/tests/e2e/shims"
	)
	COMMON=(
		-m sglang.launch_server --model-path "$MODEL" --served-model-name tiny --host 127.0.0.1
		--device cpu --attention-backend torch_native --disable-overlap-schedule
		--max-total-tokens 4096 --context-length 512 --random-seed 0 --enable-metrics --sleep-on-idle
	)
	say "starting SGLang single :$SINGLE_PORT, prefill :$PREFILL_PORT (bootstrap :$BOOTSTRAP_PORT), decode :$DECODE_PORT"
	start single env "${COMMON_ENV[@]}" "$PY" "${COMMON[@]}" --port "$SINGLE_PORT"
	start prefill env "${COMMON_ENV[@]}" "$PY" "${COMMON[@]}" --port "$PREFILL_PORT" \
		--disaggregation-mode prefill --disaggregation-transfer-backend mooncake_tcp \
		--disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
	start decode env "${COMMON_ENV[@]}" "$PY" "${COMMON[@]}" --port "$DECODE_PORT" \
		--disaggregation-mode decode --disaggregation-transfer-backend mooncake_tcp \
		--disaggregation-decode-retraction-backup cpu_tensor
	HEALTH=/health
	GW_ARGS=(--engine sglang --prefill "http://127.0.0.1:$PREFILL_PORT" "$BOOTSTRAP_PORT"
		--decode "http://127.0.0.1:$DECODE_PORT")
fi

wait_http single "http://127.0.0.1:$SINGLE_PORT$HEALTH"
wait_http prefill "http://127.0.0.1:$PREFILL_PORT$HEALTH"
wait_http decode "http://127.0.0.1:$DECODE_PORT$HEALTH"
for name in single prefill decode; do pin "$name"; done
say "engines up, pinned to CPU $ENGINE_CPUS"

# A CPU engine's first forward pass of each kind (a completion, a chat) does its one-off set-up
# (kernel selection, template compile): seconds on a quiet machine, past the gateway's 60 s
# prefill deadline on a busy one (seen: 31 s, and two chat prefills cut at 60 s). Warm every
# server directly, one at a time, with a generous deadline, so tests measure answers, not set-up.
# An SGLang prefill or decode serves only P/D pairs, so there only the single server is warmed.
# vLLM: the first request that asks for logprobs compiles vLLM's rank kernel with torch.compile
# (inductor: C++ built with the system compiler; `batched_count_greater_than`, v1/sample/ops/
# logprobs.py), whatever --enforce-eager says: 70 s on a busy 2-core machine (2026-12-06: 36 s
# tracing, 41 s compiling), past the 60 s deadlines of the gateway's prefill and of the tests'
# client. The gateway asks every greedy vLLM prefill for logprobs (its near-tie check), so vLLM's
# completion warm-up asks for them too (the first server pays the compile; the others load it
# from inductor's disk cache).
warm() {
	local name=$1 base=$2 t lp=''
	[[ $ENGINE == vllm ]] && lp=',"logprobs":1'
	t=$(curl -fsS -o /dev/null -w '%{time_total}' --max-time 600 "$base/v1/completions" -H 'content-type: application/json' \
		-d '{"model":"tiny","prompt":"warm up","max_tokens":1,"temperature":0'"$lp"'}') &&
		say "$name: completion warm-up ${t}s" || say "$name: completion warm-up failed"
	t=$(curl -fsS -o /dev/null -w '%{time_total}' --max-time 600 "$base/v1/chat/completions" -H 'content-type: application/json' \
		-d '{"model":"tiny","messages":[{"role":"user","content":"warm up"}],"max_tokens":1,"temperature":0}') &&
		say "$name: chat warm-up ${t}s" || say "$name: chat warm-up failed"
}
warm single "http://127.0.0.1:$SINGLE_PORT"
if [[ $ENGINE == vllm ]]; then
	warm prefill "http://127.0.0.1:$PREFILL_PORT"
	warm decode "http://127.0.0.1:$DECODE_PORT"
	# ... and the P/D path itself, which those requests do not reach: a prefill asked for its KV
	# and its near-tie logprobs (chat's as well), the decode's first NIXL handshake and KV pull.
	# One handoff of each kind, as the gateway sends it, each leg timed and given
	# E2E_WARM_TIMEOUT_S (600); a failure ends the lane here, naming the leg.
	"$ROOT/.venv/bin/python" -m tests.e2e.handoff "http://127.0.0.1:$PREFILL_PORT" \
		"http://127.0.0.1:$DECODE_PORT" tiny "${E2E_WARM_TIMEOUT_S:-600}" ||
		{ say "the P/D warm-up failed: the pair cannot hand over KV (see above)"; exit 1; }
fi
say "engines warmed"

# -- gateway -------------------------------------------------------------------------------------
# the model's vocabulary, so that prompt ids outside it are refused before an engine sees them
VOCAB=$("$ROOT/.venv/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")
start gateway "$GW_BIN" serve "${GW_ARGS[@]}" --vocab-size "$VOCAB" --host 127.0.0.1 --port "$GATEWAY_PORT" --log-level info
wait_http gateway "http://127.0.0.1:$GATEWAY_PORT/readiness"

# -- tests ---------------------------------------------------------------------------------------
export E2E_ENGINE=$ENGINE E2E_MODEL=tiny E2E_MAX_MODEL_LEN=512 E2E_RUN_DIR=$RUN_DIR E2E_VOCAB_SIZE=$VOCAB
export E2E_GATEWAY_URL=http://127.0.0.1:$GATEWAY_PORT
export E2E_REFERENCE_URL=http://127.0.0.1:$SINGLE_PORT
export E2E_PREFILL_URL=http://127.0.0.1:$PREFILL_PORT
export E2E_DECODE_URL=http://127.0.0.1:$DECODE_PORT
export E2E_PREFILL_PGID=${PGID[prefill]} E2E_DECODE_PGID=${PGID[decode]}
export E2E_BOOTSTRAP_PORT=$BOOTSTRAP_PORT
if [[ -n ${E2E_HOLD:-} ]]; then # debugging: keep everything up until this script is stopped
	env | grep '^E2E_' | sed 's/^/export /' >"$RUN_DIR/env.sh"
	say "holding; source $RUN_DIR/env.sh; stop with: kill -TERM $$"
	while true; do sleep 1; done
fi
say "pytest"
rc=0
# a hard bound on the whole test run, on top of each test's own timeout
timeout -k 15 "${E2E_PYTEST_TIMEOUT_S:-900}" \
	"$ROOT/.venv/bin/python" -m pytest -m e2e tests/e2e -p no:cacheprovider "$@" || rc=$?
say "pytest exit $rc"
exit "$rc"
