"""Pictures: functions that return data, and separate `plot_*` functions that draw it."""
