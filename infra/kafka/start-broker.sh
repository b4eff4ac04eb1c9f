#!/bin/bash
# Start the one-node KRaft broker of docker-compose.yml with SASL/SCRAM-SHA-512 and ACLs (docs/SECURITY.md).
#
# The Apache Kafka image's own start script cannot add SCRAM credentials when it formats the storage, and a
# JAAS line cannot name a file, so this script writes the broker's configuration itself, from the environment
# and one Docker secret (the admin password), then formats the storage once with the admin's SCRAM credential
# and runs the broker:
#
#   SASL://0.0.0.0:9092        SASL_PLAINTEXT, SCRAM-SHA-512: every client and the broker itself (as admin).
#                              SCRAM never sends the password; the data network is internal (no route in or out).
#   CONTROLLER://127.0.0.1:9093  PLAINTEXT, loopback only: this node's broker talking to its own controller.
#
# Authorization: StandardAuthorizer, allow.everyone.if.no.acl.found=false, super users admin and the loopback
# controller's ANONYMOUS principal (only a process inside this container reaches 127.0.0.1:9093). Every other
# user gets exactly the ACLs kafka-init grants (create-topics.sh). The admin's client properties (for the
# healthcheck) are written 0600 to $ADMIN_CONFIG.
set -euo pipefail

BIN=${KAFKA_BIN:-/opt/kafka/bin}
CONFIG=${KAFKA_CONFIG:-/tmp/reprolane-server.properties}
ADMIN_CONFIG=${ADMIN_CONFIG:-/tmp/reprolane-admin.properties}
DATA=${KAFKA_LOG_DIRS:-/var/lib/kafka/data}
ADMIN_USER=${KAFKA_ADMIN_USER:-admin}
PASSWORD_FILE=${KAFKA_ADMIN_PASSWORD_FILE:?KAFKA_ADMIN_PASSWORD_FILE must name the admin password secret}
MECHANISM=SCRAM-SHA-512

password=$(cat "$PASSWORD_FILE")
if [ -z "$password" ]; then
    echo "start-broker: $PASSWORD_FILE is empty: put the Kafka admin password there" >&2
    exit 2
fi
case "$password" in
    *'"'* | *'\'* ) echo "start-broker: the admin password must not contain \" or \\" >&2; exit 2 ;;
    LOCAL-ONLY-change-me-*) echo "start-broker: $PASSWORD_FILE holds the example value: change it" >&2; exit 2 ;;
esac
jaas="org.apache.kafka.common.security.scram.ScramLoginModule required username=\"$ADMIN_USER\" password=\"$password\";"

umask 077
cat > "$CONFIG" <<EOF
process.roles=broker,controller
node.id=${KAFKA_NODE_ID:-1}
controller.quorum.voters=${KAFKA_NODE_ID:-1}@127.0.0.1:9093
listeners=SASL://0.0.0.0:9092,CONTROLLER://127.0.0.1:9093
advertised.listeners=SASL://${KAFKA_ADVERTISED_HOST:-kafka}:9092
listener.security.protocol.map=SASL:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL
sasl.enabled.mechanisms=$MECHANISM
sasl.mechanism.inter.broker.protocol=$MECHANISM
listener.name.sasl.scram-sha-512.sasl.jaas.config=$jaas
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:$ADMIN_USER;User:ANONYMOUS
auto.create.topics.enable=false
offsets.topic.replication.factor=${KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR:-1}
transaction.state.log.replication.factor=${KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR:-1}
transaction.state.log.min.isr=${KAFKA_TRANSACTION_STATE_LOG_MIN_ISR:-1}
group.initial.rebalance.delay.ms=0
message.max.bytes=${KAFKA_MESSAGE_MAX_BYTES:-8388608}
log.dirs=$DATA
EOF
cat > "$ADMIN_CONFIG" <<EOF
security.protocol=SASL_PLAINTEXT
sasl.mechanism=$MECHANISM
sasl.jaas.config=$jaas
EOF

# Format once (the admin's SCRAM credential goes into the first metadata); later starts keep the storage.
# kafka-storage.sh takes the credential only as an argument: it is on this container's process list for the
# second the format runs, before the broker (and anything that could connect) starts.
"$BIN/kafka-storage.sh" format --ignore-formatted --cluster-id "${CLUSTER_ID:?CLUSTER_ID is required}" \
    --config "$CONFIG" --add-scram "$MECHANISM=[name=$ADMIN_USER,password=$password]"
exec "$BIN/kafka-server-start.sh" "$CONFIG"
