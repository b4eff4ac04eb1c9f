#!/bin/sh
# Entrypoint of the reprolane image: check the secret files, drop empty settings, then exec the command.
#
# Docker secrets arrive as files under /run/secrets, named by REPROLANE_..._FILE variables. The settings objects
# read those files themselves (infra/clients/connection.py: every secret field has a *_file twin), so a secret's value
# never enters any process environment, where child processes and /proc/<pid>/environ would see it. This script
# only fails fast when a _FILE names a missing file (a secret that was meant to be there must not silently
# vanish). An empty REPROLANE_ variable means "not set" and is removed, so an optional setting left blank in
# docker-compose.yml stays None instead of "".
set -eu

for name in $(env | sed -n 's/^\(REPROLANE_[A-Za-z0-9_]*\)=.*$/\1/p'); do
    eval "value=\${$name}"
    if [ -z "$value" ]; then
        unset "$name"
        continue
    fi
    case "$name" in
        *_FILE)
            if [ ! -f "$value" ]; then
                echo "entrypoint: $name names $value, which is not a file" >&2
                exit 2
            fi
            ;;
    esac
done

exec "$@"
