"""The command line: `triage-worker` (`cli.main`) and one `*_command` module per sub-command, with what only
commands use: argument checks, flag defaults, the terminal viewer, pipes, the start of a `run` child and, for
now, the model's hot reload (`reload`). May import every room.
"""
