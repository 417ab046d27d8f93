#!/bin/bash
# The start-up script of every worker of a midas_jax slice: launch/tpu_pod.py puts it in the TPU VM's
# (or queued resource's) metadata as `startup-script`, so it runs as root on every boot: the first
# one, the one after a maintenance event, and that of a slice re-created after a preemption. It
# fetches the checkout and the run's systemd unit from the stage on GCS, installs uv, a uv-managed
# Python and the package (the image's python3 is too old for the pins) from the wheelhouse staged beside
# the checkout (no package index), and enables and starts the unit, whose run resumes from its workdir. The install stays on the boot disk: when the stage is
# the one installed (a reboot), nothing is installed and a run the boot started already goes on.
# `sudo google_metadata_script_runner startup` runs it again (`tpu_pod.py run` does, after staging).
set -euo pipefail

# launch/tpu_pod.py fills these in.
STAGE=@STAGE@
UNIT=@UNIT@
EXTRAS=@EXTRAS@
PYTHON_VERSION=@PYTHON_VERSION@
UV_VERSION=@UV_VERSION@
WHEELHOUSE=@WHEELHOUSE@  # the stage's folder of every wheel to install (no package index), or off (PyPI)

MIDAS_ROOT=${MIDAS_ROOT:-/opt/midas}        # checkout, uv, Python and the venv
UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
RUN_DIR=${RUN_DIR:-/run}                    # where the unit notes how the run last ended (_tpu_worker.py)
RETRY_DELAY_S=${RETRY_DELAY_S:-15}          # the first pause; each one after doubles, up to RETRY_MAX_DELAY_S
RETRY_MAX_DELAY_S=${RETRY_MAX_DELAY_S:-120}
RETRY_TRIES=${RETRY_TRIES:-8}               # 15 + 30 + 60 + 4 x 120 s: about 10 minutes before giving up

log() { echo "midas start-up: $*"; }

retry() {  # GCS, the package index and Python's download can fail for minutes while a VM boots
  local attempt=1 delay=$RETRY_DELAY_S
  until "$@"; do
    if [ "$attempt" -ge "$RETRY_TRIES" ]; then
      log "gave up after $attempt tries: $*"
      return 1
    fi
    log "try $attempt failed; again in $delay s: $*"
    sleep "$delay"
    attempt=$((attempt + 1))
    delay=$((delay * 2 > RETRY_MAX_DELAY_S ? RETRY_MAX_DELAY_S : delay * 2))
  done
}

mkdir -p "$MIDAS_ROOT/stage"
log "fetching the checkout and $UNIT.service from $STAGE"
retry gcloud storage cp "$STAGE/midas_src.tgz" "$STAGE/$UNIT.service" "$MIDAS_ROOT/stage/"

installed() {  # the stage is the one whose install finished
  cmp -s "$MIDAS_ROOT/stage/midas_src.tgz" "$MIDAS_ROOT/installed/midas_src.tgz" &&
    cmp -s "$MIDAS_ROOT/stage/$UNIT.service" "$MIDAS_ROOT/installed/$UNIT.service" &&
    [ -x "$MIDAS_ROOT/venv/bin/python" ] && [ -f "$UNIT_DIR/$UNIT.service" ]
}

if installed; then
  log "$UNIT is installed from this stage already (a reboot): nothing to install"
  if [ -f "$MIDAS_ROOT/$UNIT.ended" ]; then
    log "not started: the run ended with status $(cat "$MIDAS_ROOT/$UNIT.ended") (docs/pods.md#exit-statuses);" \
      "\`tpu_pod.py run\` starts it again"
    exit 0
  fi
  systemctl enable "$UNIT"
  systemctl start "$UNIT"  # nothing to do when the boot started it already
  log "$UNIT is running (sudo journalctl -u $UNIT -f follows it)"
  exit 0
fi

# A new stage (`tpu_pod.py run`) or a first boot: the run saves (SIGTERM) and stops before its code is replaced.
systemctl stop "$UNIT" 2>/dev/null || true
rm -rf "$MIDAS_ROOT/installed" "$MIDAS_ROOT/src"
mkdir -p "$MIDAS_ROOT/src"
tar xzf "$MIDAS_ROOT/stage/midas_src.tgz" -C "$MIDAS_ROOT/src"

FROM=()  # where pip and uv find packages: the package index, unless a wheelhouse is staged
if [ "$WHEELHOUSE" != off ]; then
  log "fetching the wheelhouse from $STAGE/$WHEELHOUSE"
  mkdir -p "$MIDAS_ROOT/$WHEELHOUSE"
  retry gcloud storage rsync --recursive --delete-unmatched-destination-objects "$STAGE/$WHEELHOUSE" \
    "$MIDAS_ROOT/$WHEELHOUSE"
  FROM=(--no-index --find-links "$MIDAS_ROOT/$WHEELHOUSE")
fi

UV="$MIDAS_ROOT/uv/bin/uv"
if [ ! -x "$UV" ]; then
  log "installing uv $UV_VERSION (${FROM[*]:-from PyPI})"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    retry apt-get update -q
    retry apt-get install -y -q python3-pip
  fi
  retry python3 -m pip install -q --target "$MIDAS_ROOT/uv" ${FROM[@]+"${FROM[@]}"} "uv==$UV_VERSION"
fi
export UV_PYTHON_INSTALL_DIR="$MIDAS_ROOT/python" UV_CACHE_DIR="$MIDAS_ROOT/cache"
if [ ! -x "$MIDAS_ROOT/venv/bin/python" ]; then
  log "installing Python $PYTHON_VERSION (uv-managed, whatever python3 the image has)"
  retry "$UV" python install "$PYTHON_VERSION"
  "$UV" venv --python "$PYTHON_VERSION" "$MIDAS_ROOT/venv"
fi
log "installing midas_jax[$EXTRAS] (${FROM[*]:-from PyPI})"
retry "$UV" pip install -q --python "$MIDAS_ROOT/venv/bin/python" ${FROM[@]+"${FROM[@]}"} \
  -c "$MIDAS_ROOT/src/requirements/constraints.txt" -e "$MIDAS_ROOT/src[$EXTRAS]"

sed "s|@MIDAS_ROOT@|$MIDAS_ROOT|g" "$MIDAS_ROOT/stage/$UNIT.service" > "$UNIT_DIR/$UNIT.service"
cp -r "$MIDAS_ROOT/stage" "$MIDAS_ROOT/installed"
rm -f "$MIDAS_ROOT/$UNIT.ended" "$RUN_DIR/$UNIT.last_exit"  # a new stage starts at once, whatever ended before
systemctl daemon-reload
systemctl enable "$UNIT"  # every boot starts it, whatever this script then does
systemctl reset-failed "$UNIT" 2>/dev/null || true
systemctl start "$UNIT"
log "started $UNIT (sudo journalctl -u $UNIT -f follows it)"
