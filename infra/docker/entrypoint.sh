#!/bin/sh
# Entrypoint of the reprolane image: secrets from files, then exec the command.
#
# Docker secrets arrive as files under /run/secrets. For every variable REPROLANE_..._FILE=/path whose file
# exists and is not empty, export REPROLANE_... with the file's content (trailing newline removed) and unset the
# _FILE variable, so the settings objects (pydantic-settings, prefixes REPROLANE_CAPTURE_, REPROLANE_REPLAYER_,
# ...) see only their own fields. An empty REPROLANE_ variable means "not set" and is removed, so an optional
# setting left blank in docker-compose.yml (for example KAFKA_SASL_MECHANISM) stays None instead of "".
# A _FILE that names a missing file is an error: a secret that was meant to be there must not silently vanish.
set -eu

for name in $(env | sed -n 's/^\(REPROLANE_[A-Za-z0-9_]*\)=.*$/\1/p'); do
    eval "value=\${$name}"
    case "$name" in
        *_FILE)
            target=${name%_FILE}
            if [ ! -f "$value" ]; then
                echo "entrypoint: $name names $value, which is not a file" >&2
                exit 2
            fi
            content=$(cat "$value")
            unset "$name"
            if [ -n "$content" ]; then
                export "$target=$content"
            fi
            ;;
        *)
            if [ -z "$value" ]; then
                unset "$name"
            fi
            ;;
    esac
done

exec "$@"
