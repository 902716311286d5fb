from switchyard.gateway.service import main

main()
