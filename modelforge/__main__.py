from modelforge._fastcli import main

main()
