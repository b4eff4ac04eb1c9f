#!/bin/bash
# Create (or reconcile) reprolane's Kafka topics; idempotent, run by the kafka-init service of
# docker-compose.yml with the Apache Kafka image's own tools.
#
# The names are schemas/layout.py's (tests/infra/test_deploy_files.py checks that they match). Every topic
# is keyed by request_id, so all records of one request land in one partition, in order; the partition
# count of the envelope topic bounds how many replayers of one consumer group do work (docs/SCALING.md).
# Existing topics get their configuration re-applied and their partition count raised (never lowered:
# Kafka cannot, and raising it re-maps keys, so raise it before traffic, not during).
set -euo pipefail

BIN=${KAFKA_BIN:-/opt/kafka/bin}
BOOTSTRAP=${KAFKA_BOOTSTRAP:-kafka:9092}
RF=${REPLICATION_FACTOR:-1}
MAX_BYTES=${MESSAGE_MAX_BYTES:-8388608}
ENVELOPE_PARTITIONS=${ENVELOPE_PARTITIONS:-12}
ENVELOPE_RETENTION_MS=${ENVELOPE_RETENTION_MS:-604800000}   # 7 days: S3 is the system of record
MIN_ISR=$(( RF >= 3 ? 2 : 1 ))

# name | partitions | retention.ms | max.message.bytes
TOPICS=(
    "reprolane.envelopes.v1|${ENVELOPE_PARTITIONS}|${ENVELOPE_RETENTION_MS}|${MAX_BYTES}"
    "reprolane.divergences.v1|${ENVELOPE_PARTITIONS}|2592000000|1048576"
    "reprolane.replay-requests.v1|${ENVELOPE_PARTITIONS}|604800000|1048576"
    "reprolane.dead-letter.v1|3|2592000000|${MAX_BYTES}"
)

for spec in "${TOPICS[@]}"; do
    IFS='|' read -r name partitions retention max_bytes <<< "$spec"
    settings=("retention.ms=${retention}" "max.message.bytes=${max_bytes}" "min.insync.replicas=${MIN_ISR}"
        "cleanup.policy=delete")
    create_args=()
    for setting in "${settings[@]}"; do create_args+=(--config "$setting"); done
    config=$(IFS=,; echo "${settings[*]}")
    "$BIN/kafka-topics.sh" --bootstrap-server "$BOOTSTRAP" --create --if-not-exists --topic "$name" \
        --partitions "$partitions" --replication-factor "$RF" "${create_args[@]}" > /dev/null
    "$BIN/kafka-configs.sh" --bootstrap-server "$BOOTSTRAP" --alter --entity-type topics --entity-name "$name" \
        --add-config "$config" > /dev/null
    current=$("$BIN/kafka-topics.sh" --bootstrap-server "$BOOTSTRAP" --describe --topic "$name" \
        | sed -n 's/.*PartitionCount: *\([0-9]*\).*/\1/p' | head -n 1)
    if [ "${current:-0}" -lt "$partitions" ]; then
        "$BIN/kafka-topics.sh" --bootstrap-server "$BOOTSTRAP" --alter --topic "$name" --partitions "$partitions"
    fi
    echo "topic $name: partitions>=$partitions rf=$RF $config"
done
