#!/bin/bash
# The start-up script of every worker of a midas_jax slice: launch/tpu_pod.py puts it in the TPU VM's
# (or queued resource's) metadata as `startup-script`, so it runs as root on every boot: the first
# one, the one after a maintenance event, and that of a slice re-created after a preemption. It
# fetches the checkout and the run's systemd unit from the stage on GCS, installs uv, a uv-managed
# Python and the package (the image's python3 is too old for the pins), and starts the unit, whose
# run resumes from its workdir. The install stays on the boot disk, so a reboot installs nothing new.
# `sudo google_metadata_script_runner startup` runs it again (`tpu_pod.py run` does).
set -euo pipefail

# launch/tpu_pod.py fills these in.
STAGE=@STAGE@
UNIT=@UNIT@
EXTRAS=@EXTRAS@
PYTHON_VERSION=@PYTHON_VERSION@
UV_VERSION=@UV_VERSION@

MIDAS_ROOT=${MIDAS_ROOT:-/opt/midas}        # checkout, uv, Python and the venv
UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
RETRY_DELAY_S=${RETRY_DELAY_S:-15}

log() { echo "midas start-up: $*"; }

retry() {  # GCS, PyPI and Python's download can fail for a moment while a VM boots
  local attempt=1
  until "$@"; do
    if [ "$attempt" -ge 5 ]; then
      log "gave up after $attempt tries: $*"
      return 1
    fi
    sleep $((attempt * RETRY_DELAY_S))
    attempt=$((attempt + 1))
  done
}

mkdir -p "$MIDAS_ROOT"
# Run again on a live worker: the run saves (SIGTERM) and stops before its code is replaced.
systemctl stop "$UNIT" 2>/dev/null || true

log "fetching the checkout and $UNIT.service from $STAGE"
retry gcloud storage cp "$STAGE/midas_src.tgz" "$STAGE/$UNIT.service" "$MIDAS_ROOT/"
rm -rf "$MIDAS_ROOT/src"
mkdir -p "$MIDAS_ROOT/src"
tar xzf "$MIDAS_ROOT/midas_src.tgz" -C "$MIDAS_ROOT/src"

UV="$MIDAS_ROOT/uv/bin/uv"
if [ ! -x "$UV" ]; then
  log "installing uv $UV_VERSION from PyPI"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    retry apt-get update -q
    retry apt-get install -y -q python3-pip
  fi
  retry python3 -m pip install -q --target "$MIDAS_ROOT/uv" "uv==$UV_VERSION"
fi
export UV_PYTHON_INSTALL_DIR="$MIDAS_ROOT/python" UV_CACHE_DIR="$MIDAS_ROOT/cache"
if [ ! -x "$MIDAS_ROOT/venv/bin/python" ]; then
  log "installing Python $PYTHON_VERSION (uv-managed, whatever python3 the image has)"
  retry "$UV" python install "$PYTHON_VERSION"
  "$UV" venv --python "$PYTHON_VERSION" "$MIDAS_ROOT/venv"
fi
log "installing midas_jax[$EXTRAS]"
retry "$UV" pip install -q --python "$MIDAS_ROOT/venv/bin/python" -c "$MIDAS_ROOT/src/requirements/constraints.txt" \
  -e "$MIDAS_ROOT/src[$EXTRAS]"

sed "s|@MIDAS_ROOT@|$MIDAS_ROOT|g" "$MIDAS_ROOT/$UNIT.service" > "$UNIT_DIR/$UNIT.service"
systemctl daemon-reload
systemctl reset-failed "$UNIT" 2>/dev/null || true
systemctl start "$UNIT"
log "started $UNIT (sudo journalctl -u $UNIT -f follows it)"
