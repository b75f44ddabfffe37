"""triage-worker: Kafka stream-processing worker that triages support tickets with a local ORT GenAI model.

Architecture. A record flows one way: consume → decode → dispatch → classify → encode → produce → commit.
The code is in twelve rooms, one folder each, plus a few shared modules; each room has one contract.

- ``worker/settings`` (the settings): one validated `Settings`, one frozen struct per TOML table
  (`sections`), built from defaults < TOML file < environment < command line (`loading`), every command's
  ``--config``/``--set`` (`command_line`), written back as TOML (`writing`), secrets masked (`masking`).
  Below the assembly point a part takes its own section or plain values, never the whole `Settings`.
  Imports the shared modules and `worker.privacy`; every room may import it.
- ``worker/kafka`` (Kafka I/O): client factories and the options the guarantees rely on (`clients`), one
  `produce` that waits out a full client queue, one table of Kafka error classes (`errors`), group commits
  and the transactional producer's life cycle (`commits`), topic admin and the group's lag read from the
  broker, the dead-letter header contract, a side topic read from its beginning to its end by assignment
  (`side_topics`). Imports only the shared modules.
- ``worker/inference`` (inference): loads an ORT GenAI model (checking it was trained for the taxonomy's
  labels, `pairing`), builds the prompt from a taxonomy, scores the labels or writes one down their token
  trie (`answer_trie`) in prefix-reusing contexts, at a folder's fitted temperature (`calibration`), and
  serves them from a pool. Its contract is a
  `worker.classification.Classifier`: `submit(ClassifyRequest)`, `poll() -> [(request_id, Classification)]`;
  the worker's is a `switch.SwitchingClassifier`, whose pool a hot reload replaces. A model's taxonomy is
  resolved once where the model is assembled (`loading.resolve_taxonomy`, called by `worker.app` or a
  command) and handed to its pool, engines and encoder stage as a value; an LLM may decide among the encoder
  stage's top candidates (`candidates`). Imports only the shared modules.
- ``worker/pipeline`` (the pipeline): the one loop every door rides (`engine.Engine`): the in-flight bound,
  deadlines, the Schema Registry's wait, drains on revoke, shutdown; over three seams (`seams`): where
  records come from (`sources/`: a consumer group, a share group, the lines of a file), what happens to each
  (`triage/`: intake, the dispatch queue, the model stage with its cascade, the outputs) and how each is
  settled (`settlements/`: the delivery guarantees, at least once or in Kafka transactions, committed on a
  committer thread over offsets finished in order; a share group's acknowledgements; results in input
  order; the delivery-error rules once); the side topics (`side_topics/`: shadow, review). Imports the
  shared modules and `worker.kafka`; never ONNX Runtime.
- ``worker/replay`` (replay): republishing dead letters on the pipeline's loop: the dead-letter ranges
  planned at start as its source, selecting, repairing and republishing as its stage, settled through the
  pipeline's delivery guarantees (`reports` is their observer). Imports the shared modules, `worker.kafka`
  and `worker.pipeline`.
- ``worker/telemetry`` (telemetry): one HTTP port per process: the Prometheus collectors, liveness and
  readiness probes, the reload hook, a replay's progress; per-ticket OpenTelemetry traces (`tracing`, behind
  the pipeline's `tracing` seam; off, and not even imported, unless configured). Imports the shared modules
  and the rooms above.
- ``worker/learning`` (learning): the trainers as a library: ticket exports in (`data`), the encoder stage
  from tickets or zero-shot (`encoder_stage`), its encoder fine-tuned on a full folder's tickets
  (`encoder_tuning`), its out-of-scope detector (`out_of_scope`), the first stage (`first_stage`), both
  stages into one model folder (`compose`), where a model folder may be written and how it replaces the old
  one (`folders`), the ORT GenAI export (`export`), a published model imported (`model_import`) and its
  confidence fitted to a taxonomy (`calibration`), evaluation on BANKING77 (`evaluation`), reviewers'
  feedback (`feedback`) and the fine-tune on it (`fine_tune`), model files fetched with Maven (`artifacts`).
  Imports the shared modules, `worker.inference`, `worker.kafka` and `worker.pipeline` (the feedback topic
  read, its rejects dead-lettered with the pipeline's redaction); never `worker.cli` or `worker.dev`.
- ``worker/contracts`` (data contracts): tickets in the Schema Registry formats (Avro, JSON Schema,
  Protobuf in the Confluent wire format) mapped to a TicketEvent or a dead-letter reason (`input`), and the
  Avro schema generated from the message contracts (`avro_schema`). Imports only the shared modules.
- ``worker/app`` (the assembly point): every door assembled from the one loop (`doors`: `run` in group and
  queue mode; `offline`: `classify` and `model eval`; `replay`: `triage-worker replay`), SIGTERM/SIGINT for
  a command that runs until stopped (`signals`), and the running worker built from its settings
  (`application.WorkerApp`): the primary pool behind a switch, the cascade's escalation stage, the shadow,
  the review (started by `stages`), the loop, the telemetry port and the hot reloader (`reload`, on SIGHUP
  or `POST /reload`); it owns the life cycle: start, run until stopped, drain, close, exit code. Imports
  every production room; never `worker.cli` or `worker.dev`.
- ``worker/cli`` (the command line): `triage-worker` (`cli`) and one `*_command` module per sub-command
  (the lag exporter is `lag_command`), each thin (arguments, settings, then `worker.app` or a room's
  library, then the exit code; no command module imports another), with what only the commands use:
  argument checks, `run`'s setting flags (`flags`), flag defaults, the terminal viewer, pipes, the start
  of a `run` child. May import everything.
- ``worker/dev`` (development only): the local broker and Schema Registry (`local_broker`, `local_registry`),
  the sample tickets (`samples`, `sample_tickets.csv`), the generated parts of docs/ (`reference`). Imports
  the shared modules, `worker.kafka`, and for `reference` the settings' and collectors' rooms and the CLI's
  flags (`worker.pipeline`, `worker.telemetry`, `worker.cli`). Of the worker, only `worker.cli` imports it.
- ``worker/privacy`` (personal data): finds card numbers, IBANs, e-mail addresses, phone numbers and US
  SSNs in ticket text and redacts them (`Redactor.scan`, once per ticket); every copy the worker makes of a
  ticket (review records, logs, dead-letter messages, training corrections) takes its text from it, and
  `values` redacts a record's raw bytes by their wire format (dead-letter values, keys and headers).
  Imports nothing of the worker, so every room and the shared modules may import it.
- Shared: `messages` (the Kafka message contracts), `classification` (the classifier contract), `decoding`
  (bytes → TicketEvent or the dead-letter reason), `small_files` (settings files and taxonomies, read with
  a bound), `logs`, `errors`.

`tests/project/test_architecture.py` checks the import rules, that no room but `cli` and `dev` imports
either, and that no command module imports another.
"""

__version__ = "0.1.0"
