from jabascli.cli.app import main

main()
