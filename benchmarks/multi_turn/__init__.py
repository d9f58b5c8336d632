"""Multi-turn benchmark (``python -m benchmarks.multi_turn``; see ``cli`` for the options).

    configs   vanilla (with or without vLLM's prefix cache) or kvcompress with +reuse=on|prompts|off
    workload  scripted conversations (chat filler, or a pass key recalled in the last turn)
              and each turn's prompt through the chat template
    driver    every conversation turn by turn through an in-process engine: TTFT, cached
              tokens and context match per request
    summary   per-turn and per-configuration figures, ratios, recall accuracy
    worker    one configuration's engine in its worker process
    report    text tables and plot
    cli       the command: conversations, one worker per configuration, the JSON
"""
