# Shared by the bench scripts. For those that compare `lanyard dev` in two
# configurations (bench/policy, bench/audit, bench/compare): start it,
# measure cached-hit throughput on Azure IMDS with wrk, alternate the two
# ABBA and print the ratio. For bench/run and bench/profile too: the
# reference nginx's configuration, tools installed when missing. Sourced,
# not run. The functions that start lanyard expect: $lanyard (the binary),
# $work (a scratch directory the caller removes), $duration (wrk's -d).

# Lanyard runs with the image's environment (Containerfile): glibc malloc
# limited to two arenas.
export MALLOC_ARENA_MAX=${MALLOC_ARENA_MAX:-2}

imds_path='/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F'
bench_pid=""
bench_host=""

bench_need() { # TOOL... : installs missing Debian packages when root
    local missing=()
    for tool in "$@"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    [ ${#missing[@]} = 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "$(basename "$0"): needs ${missing[*]}" >&2; exit 1
    fi
}

# bench_nginx_conf DIR PORT HTTP_EXTRA LOCATION_EXTRA: writes DIR/nginx.conf,
# the reference nginx the benchmarks compare with: a worker per CPU, no
# access log, keep-alive without limit, files from DIR/www on
# 127.0.0.1:PORT, with HTTP_EXTRA in the http block and LOCATION_EXTRA in
# its location (either may be empty).
bench_nginx_conf() {
    local dir=$1 port=$2 http_extra=$3 location_extra=$4
    cat >"$dir/nginx.conf" <<NGINX
worker_processes auto;
pid $dir/nginx.pid;
error_log $dir/logs/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $dir/tmp/body;
    proxy_temp_path $dir/tmp/proxy;
    fastcgi_temp_path $dir/tmp/fastcgi;
    uwsgi_temp_path $dir/tmp/uwsgi;
    scgi_temp_path $dir/tmp/scgi;
    keepalive_requests 1000000;
    $http_extra
    server {
        listen 127.0.0.1:$port;
        root $dir/www;
        location / {
            default_type application/json;
            $location_extra
        }
    }
}
NGINX
}

# bench_lanyard: sets $lanyard to the binary to measure: BENCH_LANYARD
# (bench/run passes the one it measures), else this tree's build in
# BENCH_PROFILE (default release).
bench_lanyard() {
    if [ -n "${BENCH_LANYARD:-}" ]; then
        lanyard=$BENCH_LANYARD
        return 0
    fi
    local profile=${BENCH_PROFILE:-release} dir
    cargo build --profile "$profile" --locked --quiet --bin lanyard >&2
    dir=$profile
    [ "$profile" != dev ] || dir=debug
    lanyard=${CARGO_TARGET_DIR:-$PWD/target}/$dir/lanyard
}

bench_stop() {
    if [ -n "$bench_pid" ]; then kill "$bench_pid" 2>/dev/null; wait "$bench_pid" 2>/dev/null || true; fi
    bench_pid=""
}

# bench_start CONFIG|- : starts `lanyard dev` (with --config CONFIG unless
# -) as $bench_pid, waits until it is ready and has answered one Azure IMDS
# request (its body in $work/answer), and sets $bench_host to its SDK
# surfaces' host:port; says why and exits 1 when it cannot.
bench_start() {
    local out=$work/dev.out args=()
    [ "$1" != - ] && args=(--config "$1")
    # INVARIANT: the output file is removed before the server starts, so the
    # readiness wait below can only read what this server printed.
    rm -f "$out"
    "$lanyard" "${args[@]}" dev --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 >"$out" 2>"$work/dev.err" &
    bench_pid=$!
    local ready=0
    for _ in $(seq 100); do
        if grep -q "lanyard dev ready" "$out" 2>/dev/null; then ready=1; break; fi
        kill -0 "$bench_pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ "$ready" = 0 ]; then
        echo "$(basename "$0"): lanyard dev exited or was not ready within 10 s" >&2; cat "$work/dev.err" >&2; bench_stop; exit 1
    fi
    bench_host=$(sed -n 's/^export GCE_METADATA_HOST=//p' "$out")
    local code; code=$(curl -s -o "$work/answer" -w '%{http_code}' -H Metadata:true "http://$bench_host$imds_path") || true
    if [ "$code" != 200 ]; then
        echo "$(basename "$0"): lanyard dev at $bench_host answered ${code:-nothing}" >&2; cat "$work/dev.err" >&2; bench_stop; exit 1
    fi
}

# bench_measure CONFIG|- : starts `lanyard dev` (with --config CONFIG unless
# -), warms it, prints "requests/s p99 [non-2xx:N]" of a wrk run, stops it.
# Call it in a command substitution, `line=$(bench_measure ...)`, never a
# process substitution: the caller must wait until this run's server has
# stopped before it starts the next one.
bench_measure() {
    bench_start "$1"
    local host=$bench_host
    wrk -t2 -c64 -d2s -H 'Metadata: true' "http://$host$imds_path" >/dev/null
    local t0 t1
    t0=$(bench_cpu_ticks "$bench_pid")
    wrk --latency -t2 -c64 -d"$duration" -H 'Metadata: true' "http://$host$imds_path" >"$work/wrk.out"
    t1=$(bench_cpu_ticks "$bench_pid")
    awk '/Requests\/sec/ {rps=$2} /^ +99%/ {p99=$2} /Non-2xx/ {bad=$4} END {print rps, p99, (bad ? "non-2xx:" bad : "")}' "$work/wrk.out"
    # The server's CPU per request of the measured run, for callers that
    # want it (bench/compare): microseconds, from /proc's clock ticks.
    awk -v t=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" '/ requests in / {n=$1} END {if (n > 0) printf "%.2f\n", t / hz / n * 1e6}' \
        "$work/wrk.out" >"$work/cpu.last"
    bench_file_sink_stats "$1" "$work/dev.out"
    bench_stop
}

# bench_cpu_ticks PID: user + system CPU of the process, in clock ticks.
bench_cpu_ticks() {
    sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $12 + $13 }'
}

# bench_file_sink_stats CONFIG DEV_OUT: when the run wrote an audit file,
# appends "CONFIG batches records write_seconds" (the file sink's batches,
# records written and the time spent writing and syncing them, from
# /metrics, warm-up included) to $work/file-sink.stats.
bench_file_sink_stats() {
    local admin
    admin=$(sed -n 's/^# lanyard admin //p' "$2")
    [ -n "$admin" ] || return 0
    curl -s "$admin/metrics" | awk -v c="$1" '
        /^lanyard_audit_write_seconds_count/ {n=$2}
        /^lanyard_audit_write_seconds_sum/ {s=$2}
        /^lanyard_audit_records_total\{sink="file",result="written"\}/ {r=$2}
        END {if (n > 0) print c, n, r, s}' >>"$work/file-sink.stats"
}

# bench_file_sink_summary CONFIG: the runs of CONFIG in $work/file-sink.stats
# in one line: records per batch and the mean time to write and sync one.
bench_file_sink_summary() {
    awk -v c="$1" '$1 == c {n+=$2; r+=$3; s+=$4}
        END {if (n > 0) printf "file sink: %d batches, %.1f records per batch, %.0f µs to write and sync a batch (mean)\n", n, r / n, s / n * 1e6}' \
        "$work/file-sink.stats" 2>/dev/null
}

# bench_abba NAME_A CONFIG_A NAME_B CONFIG_B : A B B A, BENCH_ABBA_ROUNDS
# times (default 2), a table and the ratio B/A of the mean requests/s.
bench_abba() {
    local -A config=(["$1"]=$2 ["$3"]=$4) sum=(["$1"]=0 ["$3"]=0)
    echo "| run | configuration | requests/s | p99 |"
    echo "|---|---|---:|---:|"
    local n=0 which line rps p99 bad order=() round
    for round in $(seq "${BENCH_ABBA_ROUNDS:-2}"); do order+=("$1" "$3" "$3" "$1"); done
    for which in "${order[@]}"; do
        n=$((n + 1))
        line=$(bench_measure "${config[$which]}")
        read -r rps p99 bad <<<"$line"
        echo "| $n | $which | $rps | $p99 $bad |"
        sum[$which]=$(awk -v a="${sum[$which]}" -v b="$rps" 'BEGIN {print a + b}')
    done
    awk -v b="${sum[$3]}" -v a="${sum[$1]}" -v nb="$3" -v na="$1" 'BEGIN {printf "ratio %s / %s: %.2f\n", nb, na, b / a}'
}

# reported_port FILE PID WHAT: the port of the "listening for the WHAT
# addr=127.0.0.1:PORT" line in FILE, once PID logged it (empty if PID
# exits first or 10 s pass).
reported_port() {
    local file=$1 pid=$2 what=$3 port
    for _ in $(seq 100); do
        port=$(sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$file" 2>/dev/null \
            | sed -n "s/.*listening for the $what addr=127\.0\.0\.1:\([0-9]*\).*/\1/p" | head -n 1 || true)
        if [ -n "$port" ]; then echo "$port"; return 0; fi
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
}
