"""The chaos soak's parts (tools/soak.py is the entry point): the job it launches and watches, and the checks of
its end state."""
