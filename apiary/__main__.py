from apiary.cli import app

app()
