#!/bin/bash
# Create (or reconcile) reprolane's Kafka topics; idempotent, run by the kafka-init service of
# docker-compose.yml with the Apache Kafka image's own tools.
#
# The names are schemas/layout.py's (tests/infra/test_deploy_files.py checks that they match). Every topic
# is keyed by request_id, so all records of one request land in one partition, in order; the partition
# count of the envelope topic bounds how many replayers of one consumer group do work (docs/SCALING.md).
# Existing topics get their configuration re-applied and their partition count raised (never lowered:
# Kafka cannot, and raising it re-maps keys, so raise it before traffic, not during).
#
# With KAFKA_ADMIN_PASSWORD_FILE set (docker-compose.yml sets it) the tools log in as the admin over
# SASL_PLAINTEXT/SCRAM-SHA-512, and the script also reconciles the services' users and their ACLs:
#
#   user       password secret               may
#   capture    kafka_capture_password        write envelopes, dead-letter
#   shipper    kafka_shipper_password        write schedules, dead-letter
#   replayer   kafka_replayer_password       read envelopes, replay-requests (group reprolane-replayer*);
#                                            write divergences, dead-letter, replayer-heartbeats
#   archiver   kafka_archiver_password       read envelopes, divergences (group reprolane-archiver*)
#   monitor    kafka_monitor_password        describe every topic and group (kafka-exporter)
#
# Nobody but the admin may create, delete or alter topics, or write the on-demand replay-request topic (grant
# Write on it to the one user an operator's tooling uses: docs/SECURITY.md). Re-running adds what is missing; it
# never removes an ACL an operator added.
set -euo pipefail

BIN=${KAFKA_BIN:-/opt/kafka/bin}
BOOTSTRAP=${KAFKA_BOOTSTRAP:-kafka:9092}
RF=${REPLICATION_FACTOR:-1}
MAX_BYTES=${MESSAGE_MAX_BYTES:-8388608}
ENVELOPE_PARTITIONS=${ENVELOPE_PARTITIONS:-12}
ENVELOPE_RETENTION_MS=${ENVELOPE_RETENTION_MS:-604800000}   # 7 days: S3 is the system of record
MIN_ISR=$(( RF >= 3 ? 2 : 1 ))
SECRETS=${SECRETS_DIR:-/run/secrets}
MECHANISM=SCRAM-SHA-512

AUTH=()
if [ -n "${KAFKA_ADMIN_PASSWORD_FILE:-}" ]; then
    admin_password=$(cat "$KAFKA_ADMIN_PASSWORD_FILE")
    umask 077
    ADMIN_CONFIG=$(mktemp)
    trap 'rm -f "$ADMIN_CONFIG"' EXIT
    printf '%s\n' "security.protocol=SASL_PLAINTEXT" "sasl.mechanism=$MECHANISM" \
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"${KAFKA_ADMIN_USER:-admin}\" password=\"$admin_password\";" \
        > "$ADMIN_CONFIG"
    AUTH=(--command-config "$ADMIN_CONFIG")
fi

# name | partitions | retention.ms | max.message.bytes
TOPICS=(
    "reprolane.envelopes.v1|${ENVELOPE_PARTITIONS}|${ENVELOPE_RETENTION_MS}|${MAX_BYTES}"
    "reprolane.divergences.v1|${ENVELOPE_PARTITIONS}|2592000000|1048576"
    "reprolane.replay-requests.v1|${ENVELOPE_PARTITIONS}|604800000|1048576"
    "reprolane.dead-letter.v1|3|2592000000|${MAX_BYTES}"
    "reprolane.schedules.v1|${ENVELOPE_PARTITIONS}|${ENVELOPE_RETENTION_MS}|${MAX_BYTES}"
    "reprolane.replayer-heartbeats.v1|1|3600000|65536"
)

for spec in "${TOPICS[@]}"; do
    IFS='|' read -r name partitions retention max_bytes <<< "$spec"
    settings=("retention.ms=${retention}" "max.message.bytes=${max_bytes}" "min.insync.replicas=${MIN_ISR}"
        "cleanup.policy=delete")
    create_args=()
    for setting in "${settings[@]}"; do create_args+=(--config "$setting"); done
    config=$(IFS=,; echo "${settings[*]}")
    "$BIN/kafka-topics.sh" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --create --if-not-exists --topic "$name" \
        --partitions "$partitions" --replication-factor "$RF" "${create_args[@]}" > /dev/null
    "$BIN/kafka-configs.sh" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --alter --entity-type topics --entity-name "$name" \
        --add-config "$config" > /dev/null
    current=$("$BIN/kafka-topics.sh" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --describe --topic "$name" \
        | sed -n 's/.*PartitionCount: *\([0-9]*\).*/\1/p' | head -n 1)
    if [ "${current:-0}" -lt "$partitions" ]; then
        "$BIN/kafka-topics.sh" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --alter --topic "$name" --partitions "$partitions"
    fi
    echo "topic $name: partitions>=$partitions rf=$RF $config"
done

if [ ${#AUTH[@]} -eq 0 ]; then
    exit 0  # a PLAINTEXT broker: no users, no ACLs (docs/SECURITY.md says what that assumes)
fi

# user | password secret | ACL specs (operation:resource-type:name[:prefixed]), space separated
USERS=(
    "capture|kafka_capture_password|Write:topic:reprolane.envelopes.v1 Write:topic:reprolane.dead-letter.v1"
    "shipper|kafka_shipper_password|Write:topic:reprolane.schedules.v1 Write:topic:reprolane.dead-letter.v1"
    "replayer|kafka_replayer_password|Read:topic:reprolane.envelopes.v1 Read:topic:reprolane.replay-requests.v1 Read:group:reprolane-replayer:prefixed Write:topic:reprolane.divergences.v1 Write:topic:reprolane.dead-letter.v1 Write:topic:reprolane.replayer-heartbeats.v1"
    "archiver|kafka_archiver_password|Read:topic:reprolane.envelopes.v1 Read:topic:reprolane.divergences.v1 Read:group:reprolane-archiver:prefixed"
    "monitor|kafka_monitor_password|Describe:topic:* Describe:group:* DescribeConfigs:topic:*"
)
set -f  # the ACL specs hold a literal "*": no globbing
USER_CONFIG=$(mktemp)
trap 'rm -f "$ADMIN_CONFIG" "$USER_CONFIG"' EXIT
for spec in "${USERS[@]}"; do
    IFS='|' read -r user secret acls <<< "$spec"
    password=$(cat "$SECRETS/$secret")
    if [ -z "$password" ]; then
        echo "create-topics: $SECRETS/$secret is empty: Kafka user $user needs a password" >&2
        exit 2
    fi
    # from a 0600 file, not the command line, where the container's process list would show it
    printf '%s\n' "$MECHANISM=[password=$password]" > "$USER_CONFIG"
    "$BIN/kafka-configs.sh" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --alter --entity-type users \
        --entity-name "$user" --add-config-file "$USER_CONFIG" > /dev/null
    for acl in $acls; do
        IFS=':' read -r operation kind resource pattern <<< "$acl"
        args=(--allow-principal "User:$user" --operation "$operation" "--$kind" "$resource")
        if [ "${pattern:-}" = "prefixed" ]; then args+=(--resource-pattern-type prefixed); fi
        "$BIN/kafka-acls.sh" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --add --force "${args[@]}" > /dev/null
    done
    echo "user $user: $acls"
done
