"""Personal data in tickets (issue #33): `detector` finds card numbers, IBANs, e-mail addresses, phone numbers
and US social security numbers; `redaction` replaces them in every copy the worker makes of a ticket.

A room of its own that imports nothing else of the worker, so every other room and the shared modules (the
logs' redacting processor) may use it. See docs/privacy.md.
"""
