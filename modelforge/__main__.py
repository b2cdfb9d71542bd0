from modelforge.cli import main

main()
