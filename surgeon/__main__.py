from surgeon.cli import main

main()
