"""Worker runtime: training loop, communicators and task plug-ins."""
