"""triage-worker: Kafka stream-processing worker that triages support tickets with a local ORT GenAI model."""

__version__ = "0.1.0"
