"""Request traces on disk: what ``specdec.telemetry`` writes and what ``specdec traces`` reads.

    otlp     spans as OTLP/JSON lines (the collector's file format) and back
    format   the span and attribute names, the span files and their exporter (the writer side)
    reader   span files read back into one ``Trace`` per request
    view     one trace drawn: a terminal waterfall and a self-contained HTML page
    cli      the ``specdec traces`` commands (list / show / summary)

Each imports only those above it.
"""
