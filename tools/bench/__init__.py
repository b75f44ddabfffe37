"""The end-to-end benchmark of the worker, `python -m tools.bench` (`make bench`): one module per figure
(P1-P6), `measure` the helpers they share, `report` what they write."""
