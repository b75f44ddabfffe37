#!/usr/bin/env bash
# HEALTHCHECK of the broker image: the broker logged that it serves clients (what the local broker and
# testcontainers wait for too). The image has a JRE but none of Kafka's command-line tools.
exec grep -q "Kafka Server started" /opt/kafka/logs/server.log
