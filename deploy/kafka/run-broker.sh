#!/usr/bin/env bash
# Entry point of the broker image (Dockerfile here), with apache/kafka's contract: each KAFKA_<NAME> variable
# is the broker property <name> lower-cased, `_` → `.`, `__` → `_`, `___` → `-` (KAFKA_NODE_ID → node.id);
# without any, one KRaft node (broker + controller) on localhost:9092. CLUSTER_ID names the cluster. The log
# dir is formatted on first start; KAFKA_HEAP_OPTS and KAFKA_OPTS go to the JVM.
set -euo pipefail

config=/opt/kafka/config/server.properties
# Variables of the JVM and of images' scripts, not broker properties.
not_properties='^KAFKA_(HEAP_OPTS|OPTS|JVM_PERFORMANCE_OPTS|GC_LOG_OPTS|LOG4J_OPTS|JMX_OPTS|JMX_PORT|DEBUG|HOME|VERSION)$'

properties=$(
    compgen -e | grep -E '^KAFKA_' | grep -v -E "$not_properties" | sort | while read -r name; do
        key=$(printf '%s' "${name#KAFKA_}" | tr '[:upper:]' '[:lower:]' | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')
        printf '%s=%s\n' "$key" "${!name}"
    done
)
if [ -z "$properties" ]; then
    properties='process.roles=broker,controller
node.id=1
listeners=PLAINTEXT://:9092,CONTROLLER://:9093
advertised.listeners=PLAINTEXT://localhost:9092
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
controller.quorum.voters=1@localhost:9093
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0'
fi
if ! grep -q '^log\.dirs=' <<<"$properties"; then
    properties+=$'\nlog.dirs=/var/lib/kafka/data'
fi
printf '%s\n' "$properties" >"$config"

classpath='/opt/kafka/libs/*'
log4j=-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties
# shellcheck disable=SC2086  # the *_OPTS variables are lists of JVM flags
java_flags=(${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} ${KAFKA_OPTS:-} -Djava.awt.headless=true "$log4j")

# --standalone only where the quorum is given by bootstrap servers; a voters list is formatted as it is.
standalone=()
grep -q '^controller\.quorum\.voters=' "$config" || standalone=(--standalone)
java "${java_flags[@]}" -cp "$classpath" kafka.tools.StorageTool format --ignore-formatted \
    -t "${CLUSTER_ID:-sBCETBReQ--p1gkPepuDag}" -c "$config" "${standalone[@]}" >/dev/null
exec java "${java_flags[@]}" -cp "$classpath" kafka.Kafka "$config"
