"""docs/results.md, generated from benchmarks/results (``python -m benchmarks.results_doc``,
``--check`` in CI).

    provenance  what a result's JSON says about its run; the ledger of changes and the
                stale rule
    sections    which results each section shows, through which benchmark's table function;
                the README's headline rows
    document    the page, the README's headline block, the check
"""
