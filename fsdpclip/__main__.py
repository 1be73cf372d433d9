from fsdpclip.cli import app

app()
