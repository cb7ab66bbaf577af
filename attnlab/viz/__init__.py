"""Pictures: functions that return data, and separate `plot_*` functions that draw it.

    capture.py         capture_attention(model): per-layer probabilities from the eager backend
    attention_maps.py  layers x heads grids and single annotated heads
    viewer.py          a self-contained interactive HTML attention viewer
    positions.py       sinusoid, RoPE, ALiBi and T5-bucket pictures
    masks.py           every mask kind as a grid
    loss.py            loss and learning-rate curves from metrics.jsonl
    costs.py, rank.py  bar charts for `attnlab inspect --plot`, plots for `attnlab analyze rank`
    report.py          the functions behind `attnlab viz`

Nothing is imported here, so `import attnlab.viz.loss` (the training loop) stays light.
"""
