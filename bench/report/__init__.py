"""The tables and plots of the results (``python -m bench.report.build``)."""
