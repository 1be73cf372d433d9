"""The command line: Typer commands, the rich tables of validate and plan, a run's report."""
