"""The command line: `triage-worker` (`cli.main`) and one `*_command` module per sub-command, each thin (the
running worker is assembled in `worker.app`; no command module imports another), with what only commands
use: argument checks, `run`'s setting flags (`flags`), flag defaults, the terminal viewer, pipes, the start
of a `run` child. May import every room.
"""
