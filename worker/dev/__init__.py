"""Development-only parts: what a checkout or a demo needs and the running worker never imports.

`local_broker` and `local_registry` start a Kafka broker and a Schema Registry from Maven jars (`broker`,
`registry`, the demo and the tests); `samples` produces the shipped sample tickets (`sample_tickets.csv`);
`reference` writes the generated parts of docs/ (`make docs`). Only the command line (worker/cli) imports
them.
"""
