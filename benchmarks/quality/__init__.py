"""Long-context quality benchmark (``python -m benchmarks.quality``; see ``cli`` for the options).

    words    word pools the prompts are made of
    tasks    seeded RULER-style task generators (prompt, answers, metric)
    scoring  outputs -> accuracy, retained share and fidelity per configuration
    question the question inside the compressed prompt, or outside it (kvpress's evaluation:
             the context compressed alone, the question asked from its cache)
    report   text table and plot (also redrawn from a saved JSON)
    cli      the command: prompts, one engine run per configuration in workers, outputs
"""
