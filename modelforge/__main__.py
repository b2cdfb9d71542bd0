from modelforge._fastcli import main

# Guarded: a process the what-if spawns for its second replay imports this module again, as
# `__mp_main__`, and must not run the command line a second time.
if __name__ == "__main__":
    main()
