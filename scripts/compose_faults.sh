#!/usr/bin/env bash
# Faults a running compose training run (podman) at set RL steps and records what happened:
#
#   scripts/compose_faults.sh OUT.json [REDIS_AFTER_STEP [ROLLOUT_AFTER_STEP [DELAY_S]]]
#
# Watches the run folder's metrics.jsonl in the `data` volume (project $PROJECT, default
# sinkflex). DELAY_S (default 20) seconds after RL step REDIS_AFTER_STEP (default 2) has been
# trained — while the next step's rollouts run — it restarts the Redis container
# (`podman restart`: SIGTERM, Redis writes its append-only file, then starts again). DELAY_S
# seconds after step ROLLOUT_AFTER_STEP (default 6) it SIGKILLs the rollout container's main
# process (a crash: compose's `restart: unless-stopped` must start it again). For each, it
# waits until the container runs again and its health check passes, and writes OUT.json:
#   [{container, action, after_step, at, back_running_s, healthy_s, restart_count}]
# (at: unix seconds; *_s: seconds after the fault; null: not within 900 s). Whether the run
# survived each fault is the run's own record (summary.json): this script does not judge it.
set -euo pipefail
OUT=$1
REDIS_AFTER=${2:-2}
ROLLOUT_AFTER=${3:-6}
DELAY=${4:-20}
PROJECT=${PROJECT:-sinkflex}
trained_steps() {  # RL steps in the run folder's metrics (0 before the volume or file exists)
  local volume
  volume=$(podman volume inspect --format '{{.Mountpoint}}' "${PROJECT}_data" 2>/dev/null) || { echo 0; return; }
  [ -f "$volume/run/metrics.jsonl" ] || { echo 0; return; }
  grep -c '"kind": "train"' "$volume/run/metrics.jsonl" || true
}

container() {  # service -> container id
  podman ps -a -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" | head -1
}

wait_back() {  # id t0 -> "back_running_s healthy_s" (after t0)
  local id=$1 t0=$2 running=null healthy=null pid0=$3 now
  for _ in $(seq 1 900); do
    now=$(date +%s.%N)
    if [ "$running" = null ] && [ "$(podman inspect --format '{{.State.Running}}' "$id")" = true ] \
       && [ "$(podman inspect --format '{{.State.Pid}}' "$id")" != "$pid0" ]; then
      running=$(echo "$now - $t0" | bc)
    fi
    if [ "$running" != null ] && podman healthcheck run "$id" >/dev/null 2>&1; then
      healthy=$(echo "$(date +%s.%N) - $t0" | bc); break
    fi
    sleep 1
  done
  printf '%.1f %s' "$running" "$( [ "$healthy" = null ] && echo null || printf '%.1f' "$healthy")"
}

fault() {  # service action after_step
  local service=$1 action=$2 after=$3 id pid t0 back
  until [ "$(trained_steps)" -ge "$after" ]; do sleep 5; done
  sleep "$DELAY"
  id=$(container "$service")
  pid=$(podman inspect --format '{{.State.Pid}}' "$id")
  t0=$(date +%s.%N)
  echo "compose_faults: $action $service ($id, pid $pid) after step $after" >&2
  case "$action" in
    restart) podman restart "$id" >/dev/null 2>&1 ;;
    kill) kill -9 "$pid" ;;
  esac
  back=$(wait_back "$id" "$t0" "$pid")
  printf '{"container": "%s", "service": "%s", "action": "%s", "after_step": %s, "at": %.3f, "back_running_s": %s, "healthy_s": %s, "restart_count": %s}' \
    "$(podman inspect --format '{{.Name}}' "$id")" "$service" "$action" "$after" "$t0" \
    ${back% *} ${back#* } "$(podman inspect --format '{{.RestartCount}}' "$id")"
}

r1=$(fault redis restart "$REDIS_AFTER")
echo "compose_faults: $r1" >&2
r2=$(fault rollout-cpu kill "$ROLLOUT_AFTER")
echo "compose_faults: $r2" >&2
printf '[%s,\n %s]\n' "$r1" "$r2" >"$OUT"
