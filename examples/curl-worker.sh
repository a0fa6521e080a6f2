#!/usr/bin/env bash
# A Helix Locks worker in bash, curl and jq. Each iteration takes the lock for one organization and
# job type (retrying while it is held), renews it in the background while it works, hands the
# fencing token to what it writes, and releases it. Usage: examples/curl-worker.sh [OUTPUT_FILE]
#   HELIX_LOCKS_URL (default http://127.0.0.1:8080), HELIX_LOCKS_API_KEY (sent as a Bearer token)
#   WORKER_ORG, WORKER_JOB_TYPE  the lock's key (default acme, nightly-report)
#   WORKER_TTL           lease in seconds, renewed every TTL/3 (default 30)
#   WORKER_ITERATIONS    how many times to take the lock and work (default 1)
#   WORKER_WORK_SECONDS  how long one piece of work takes (default 1)
#   WORKER_WAIT_SECONDS  how long to retry a held lock before giving up (default 60)
#   WORKER_MAX_HOLDERS   a semaphore: up to this many workers hold the key at once, each in a slot
#                        of its own (default 1: one at a time); all of them must give the same value
#   WORKER_HOLDER        holder name (default curl-worker@HOSTNAME-PID)
#   OUTPUT_FILE or WORKER_OUTPUT  gets a line "fencing_token holder lock_id acquired_at slot" per
#                        piece of work, as a storage layer would (default worker-output.txt)
# Exit status, as `helix-locks run`'s: 0 done; 75 the lock stayed held past WORKER_WAIT_SECONDS;
# 69 the service could not be reached until then; 76 the lock was lost (410, or renewals failed until
# the lease was nearly over): the work was stopped at once and the lock not released; 1 unexpected
# answer; 2 bad configuration (max-holders-mismatch included: the key's holders share another
# WORKER_MAX_HOLDERS). SIGTERM/Ctrl-C stop the work and release the lock.
set -euo pipefail

url="${HELIX_LOCKS_URL:-http://127.0.0.1:8080}"
org="${WORKER_ORG:-acme}"
job_type="${WORKER_JOB_TYPE:-nightly-report}"
ttl="${WORKER_TTL:-30}"
iterations="${WORKER_ITERATIONS:-1}"
work_seconds="${WORKER_WORK_SECONDS:-1}"
wait_seconds="${WORKER_WAIT_SECONDS:-60}"
max_holders="${WORKER_MAX_HOLDERS:-1}"
holder="${WORKER_HOLDER:-curl-worker@${HOSTNAME:-localhost}-$$}"
output="${1:-${WORKER_OUTPUT:-worker-output.txt}}"

log() { echo "$holder: $*" >&2; }
integer='^[0-9]+$' number='^[0-9]+([.][0-9]+)?$'
if ! [[ "$ttl" =~ $number && "$work_seconds" =~ $number && "$iterations" =~ $integer &&
  "$wait_seconds" =~ $integer && "$max_holders" =~ ^[1-9][0-9]*$ ]]; then
  log "WORKER_TTL, WORKER_WORK_SECONDS, WORKER_ITERATIONS, WORKER_WAIT_SECONDS, WORKER_MAX_HOLDERS" \
    "must be numbers"; exit 2
fi
ttl_ms="$(jq -n --argjson t "$ttl" '$t * 1000 | floor')"
renew_every_ms=$((ttl_ms / 3))
secs() { printf '%d.%03d' "$(($1 / 1000))" "$(($1 % 1000))"; }
now_ms() { local t="${EPOCHREALTIME//[!0-9]/}"; echo "$((t / 1000))"; }  # bash has no monotonic clock

workdir="$(mktemp -d)"
lock_id="" token="" idempotency_key="" renewer_pid="" work_pid="" lost=0
stop() { if [[ -n "$1" ]]; then kill "$1" 2>/dev/null || true; wait "$1" || true; fi; }
cleanup() {
  stop "$renewer_pid"; stop "$work_pid"
  # Stopped (SIGTERM, Ctrl-C) or failed while holding the lock: give it back, don't let it lapse.
  if [[ -n "$token" ]]; then call release 2000 DELETE "/v1/locks/$lock_id" >/dev/null; fi
  rm -rf "$workdir"
}
trap cleanup EXIT
# The renewer sends SIGUSR1 when the lock is lost: stop the work at once. The main loop exits, not
# the trap: inside a trap, bash can miss the renewer's exit, and `wait` hangs until another job ends.
trap 'lost=1; if [[ -n "$work_pid" ]]; then kill "$work_pid" 2>/dev/null || true; fi' USR1
exit_if_lost() { if ((lost)); then log "stopping: lock $lock_id lost"; token=""; exit 76; fi; }

# Secrets reach curl through a process substitution, not its argv, which `ps` shows to anyone.
secret_headers() {
  if [[ -n "${HELIX_LOCKS_API_KEY:-}" ]]; then printf 'Authorization: Bearer %s\n' "$HELIX_LOCKS_API_KEY"; fi
  if [[ -n "$token" ]]; then printf 'Lock-Token: %s\n' "$token"; fi
  if [[ -n "$idempotency_key" ]]; then printf 'Idempotency-Key: %s\n' "$idempotency_key"; fi
}
# call NAME TIMEOUT_MS METHOD PATH [JSON]: the answer's body goes to $workdir/NAME; prints
# "STATUS RETRY_AFTER", status 000 when no answer came in time.
call() {
  local body=()
  if (($# > 4)); then body=(-H 'Content-Type: application/json' --data "$5"); fi
  curl -sS -o "$workdir/$1" -w '%{http_code} %header{retry-after}' --max-time "$(secs "$2")" \
    -X "$3" "$url$4" -H @<(secret_headers) "${body[@]}" || true
}

acquire() {  # sets lock_id, token, fencing_token, acquired_at, slot and lease_end
  local body status retry_after sent nap_ms backoff_ms=100 deadline=$((SECONDS + wait_seconds))
  body="$(jq -nc --arg o "$org" --arg j "$job_type" --arg h "$holder" --argjson t "$ttl" \
    --argjson m "$max_holders" '{organization_id: $o, job_type: $j, holder: $h, ttl_seconds: $t,
    max_holders: $m}')"
  # One key for every try of this acquire: a try whose answer was lost (or was 503) may have been
  # granted, and repeating the key gets that grant back instead of a 409 from our own lock.
  idempotency_key="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
  while :; do
    sent="$(now_ms)"
    read -r status retry_after <<<"$(call acquire 10000 POST /v1/locks "$body")"
    case "$status" in
      201) break ;;
      409)
        if [[ "$(jq -r .type "$workdir/acquire")" == *:max-holders-mismatch ]]; then
          # The key's holders share another max_holders: the setting is wrong, waiting won't help.
          log "WORKER_MAX_HOLDERS is $max_holders, the key's is $(jq .max_holders "$workdir/acquire")"
          exit 2
        fi
        # Every slot is held (one, unless a semaphore): holders names them all.
        log "lock held by $(jq -r '[(.holders // [.])[].holder] | join(", ")' "$workdir/acquire")" ;;
      000 | 503) log "service unavailable ($status)" ;;  # worth retrying too
      *) log "acquire answered $status: $(cat "$workdir/acquire")"; exit 1 ;;
    esac
    if ((SECONDS >= deadline)); then
      log "gave up after ${wait_seconds}s"
      if [[ "$status" == 409 ]]; then exit 75; else exit 69; fi
    fi
    # Retry-After is when the holder's lease ends, but a holder that finishes early releases
    # sooner: poll with a growing, jittered backoff, never waiting longer than Retry-After.
    nap_ms=$((backoff_ms + RANDOM % backoff_ms))
    if ((nap_ms > ${retry_after:-1} * 1000)); then nap_ms=$((${retry_after:-1} * 1000)); fi
    backoff_ms=$((backoff_ms * 2 > 2000 ? 2000 : backoff_ms * 2))
    sleep "$(secs "$nap_ms")"
  done
  idempotency_key=""
  IFS=$'\t' read -r lock_id token fencing_token acquired_at slot < <(
    jq -r '[.id, .token, .fencing_token, .acquired_at, .slot // 0] | @tsv' "$workdir/acquire")
  lease_end=$((sent + ttl_ms))  # counted from when we asked: never later than the real end
}

# In the background while the work runs: renew every TTL/3. A 410 means another worker holds the
# lock now; and when renewals fail until at most TTL/3 of the lease may be left, the work must
# stop before the lease ends and someone else can take over. Either way: SIGUSR1 to the worker.
renew_loop() {
  local status sent nap=""
  trap 'if [[ -n "$nap" ]]; then kill "$nap"; fi; exit 0' TERM
  while :; do
    sleep "$(secs "$renew_every_ms")" & nap=$!
    wait "$nap"
    nap=""  # its process id may belong to another process by now
    sent="$(now_ms)"  # a renewal slower than TTL/6 counts as failed, so that the margin holds
    read -r status _ <<<"$(call renew "$((renew_every_ms / 2))" POST "/v1/locks/$lock_id/renew" \
      "{\"ttl_seconds\": $ttl}")"
    case "$status" in
      200) lease_end=$((sent + ttl_ms)) ;;
      403 | 404 | 410) log "renewal answered $status: $(cat "$workdir/renew")"; kill -USR1 "$$"; exit 0 ;;
      *) if (($(now_ms) + renew_every_ms >= lease_end)); then
        log "renewals failed ($status), the lease is nearly over"; kill -USR1 "$$"; exit 0
      fi ;;
    esac
  done
}

# Release, retrying while no answer comes (or 503), for at most TTL/3: the renewer had renewed
# within TTL/3, or it would have stopped the work. A 410 answers only the right Lock-Token (a wrong
# one is 403), so release_reason "released" there means an earlier try of ours took effect and its
# answer was lost: released all the same. Returns 76 if the lock was lost.
release() {
  local status retry_after until=$(($(now_ms) + renew_every_ms))
  while :; do
    read -r status retry_after <<<"$(call release 10000 DELETE "/v1/locks/$lock_id")"
    case "$status" in
      204) return 0 ;;
      410) if [[ "$(jq -r .release_reason "$workdir/release")" == released ]]; then return 0; fi
        log "lock $lock_id was lost before its release: $(cat "$workdir/release")"; return 76 ;;
      000 | 5??) if (($(now_ms) + ${retry_after:-1} * 1000 >= until)); then
        log "release failed ($status); the lease runs out by itself"; return 0
      fi
        sleep "${retry_after:-1}" ;;
      *) log "release answered $status: $(cat "$workdir/release")"; return 1 ;;
    esac
  done
}

for ((i = 1; i <= iterations; i++)); do
  acquire
  renew_loop & renewer_pid=$!
  sleep "$work_seconds" & work_pid=$!  # the work, in the background so that the trap can stop it
  if ! wait "$work_pid" && ((!lost)); then log "the work failed"; exit 1; fi
  work_pid=""
  exit_if_lost
  # What the work writes carries the fencing token, so storage can refuse a stale holder; and the
  # slot, by which storage keys its fence when several hold the key at once (a semaphore).
  printf '%s %s %s %s %s\n' "$fencing_token" "$holder" "$lock_id" "$acquired_at" "$slot" >>"$output"
  stop "$renewer_pid"  # before releasing, so that no renewal crosses the release
  renewer_pid=""
  exit_if_lost  # the renewer may have found the lock lost in the meantime
  status=0
  release || status=$?
  token=""
  if ((status)); then exit "$status"; fi
done
log "done: $iterations iterations"
