import click

from surgeon import __version__


@click.group()
@click.version_option(__version__, prog_name="surgeon")
def main() -> None:
    """surgeon."""
