#!/bin/sh
# The `init` service of deploy/compose.yaml, run once before any node starts: creates the
# trainer's and the validator's keys in their data volumes and writes the run file that names
# them as the run's trusted peers (a trainer or validator not listed there refuses to start).
# A run file that already exists is kept, so restarts and `up` after `down` reuse the same run.
#   swarm-init-run RUN_FILE TRAINER_DATA_DIR VALIDATOR_DATA_DIR
set -eu
run=$1 trainer=$2 validator=$3
if [ "$(id -u)" = 0 ]; then
  # Named volumes first mounted where the image has no directory belong to root: hand them to the
  # nodes' uid, then carry on as that uid (setpriv is util-linux, in every Debian image).
  chown 10001:10001 "$(dirname "$run")" "$trainer" "$validator"
  exec setpriv --reuid=10001 --regid=10001 --clear-groups "$0" "$@"
fi
if [ -s "$run" ]; then
  echo "init: $run exists, keeping it"
  exit 0
fi
trainer_id=$(swarm-node keygen --data-dir "$trainer")
validator_id=$(swarm-node keygen --data-dir "$validator")
cat > "$run.tmp" <<TOML
# Written by the compose init service (deploy/init-run.sh) at first start.
[run]
name = "compose"
trainers = ["$trainer_id"]
validators = ["$validator_id"]

# Sized for one CPU host, as \`make demo\` is (node/app/demo.py).
[rl]
group_size = 8
prompts_per_batch = 4
max_new_tokens = 10

[trainer]
max_pending_batches = 12

[worker]
max_pending_batches = 2
TOML
mv "$run.tmp" "$run"
echo "init: wrote $run (trainer $trainer_id, validator $validator_id)"
