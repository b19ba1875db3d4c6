from baton.services.prefill.server import main

main()
