"""triage-worker: Kafka stream-processing worker that triages support tickets with a local ORT GenAI model.

Architecture. A record flows one way: consume → decode → dispatch → classify → encode → produce → commit.
The code is in four rooms, one folder each, plus a few shared modules; each room has one contract.

- ``worker/kafka`` (Kafka I/O): client factories and the options the guarantees rely on (`clients`), one
  `produce` that waits out a full client queue, topic admin and the group's lag read from the broker, the
  dead-letter header contract, the local development broker. Imports only the shared modules.
- ``worker/inference`` (inference): loads an ORT GenAI model (checking it was trained for the taxonomy's
  labels, `pairing`), builds the prompt from a taxonomy, scores or generates an answer in prefix-reusing
  contexts, and serves them from a pool. Its contract is a
  `worker.classification.Classifier`: `submit(ClassifyRequest)`, `poll() -> [(request_id, Classification)]`;
  the worker's is a `switch.SwitchingClassifier`, whose pool a hot reload replaces. Imports only the shared
  modules.
- ``worker/pipeline`` (the pipeline): the consumer loop (`runner.Pipeline`): the in-flight bound, deadlines,
  the ledger of records between poll and acknowledgement, offsets committed only over a finished prefix, on
  a committer thread, or in Kafka transactions with the outputs in exactly-once mode (`transactions`); the
  shadow model's side records (`shadow`). Imports the shared modules and `worker.kafka`; never ONNX Runtime.
- ``worker/ops`` (operations): the CLI commands, replay of dead letters, sample tickets, metrics and health
  endpoints and the lag exporter, hot reload of the model (`reload`), model training and evaluation, the
  generated parts of docs/ (`reference`). May import everything.
- Shared: `messages` (the Kafka message contracts), `classification` (the classifier contract), `decoding`
  (bytes → TicketEvent or the dead-letter reason), `config` (layered settings), `logs`, `errors`.

`tests/test_architecture.py` checks the import rules.
"""

__version__ = "0.1.0"
