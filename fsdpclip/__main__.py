from fsdpclip.cli.commands import app

app()
